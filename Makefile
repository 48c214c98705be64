# The two commands a newcomer needs are in README.md:
#   cargo run --release -- demo     the main job
#   make test                       every test (starts the brokers itself)

.PHONY: test test-unit demo lint bench brokers-up brokers-down doc dist bench-check

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

## What `pip install onceflow` and `npm install onceflow` get, in dist/: the abi3 manylinux wheel
## and the npm tarball with its prebuilt addon, every backend compiled in, release profile.
dist:
	bash python/dist.sh
	bash node/dist.sh

lint:
	cargo fmt --all -- --check
	cargo clippy --all-targets -- -D warnings

doc:
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps

bench:
	cargo run --release -p onceflow-bench

## The headline benchmarks in short form, each figure next to the last recorded one
## (benches/recorded.tsv); fails when one fell by more than 20 %.
bench-check:
	bash benches/check.sh

brokers-up:
	@tests/brokers/up.sh kafka nats

brokers-down:
	@tests/brokers/down.sh
