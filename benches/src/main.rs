//! `cargo run --release -p onceflow-bench -- <id>...`: runs the named benchmarks (all when none
//! is given) and prints one `RATIO <id> <what> <value> target <target> PASS|MISS` line per figure.

fn main() {}
