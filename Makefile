# The two commands a newcomer needs are in README.md:
#   cargo run --release -- demo     the main job
#   make test                       every test (starts the brokers itself)

.PHONY: test test-unit demo lint bench brokers-up brokers-down doc

## Every test, against real brokers started on loopback by tests/brokers/up.sh.
test:
	@mkdir -p target
	bash tests/run-all.sh

## What needs no broker: unit tests, the memory backend, the dedup stores.
test-unit:
	cargo test --all-targets

## The main job on the embedded default.
demo:
	cargo run --release -- demo

lint:
	cargo fmt --all -- --check
	cargo clippy --all-targets -- -D warnings

doc:
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps

bench:
	cargo run --release -p onceflow-bench

brokers-up:
	@tests/brokers/up.sh kafka nats

brokers-down:
	@tests/brokers/down.sh
