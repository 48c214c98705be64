//! `cargo run --release -p onceflow-bench -- <id>...`: runs the named benchmarks (all when none
//! is given) and prints one `RATIO <id> <what> <value> target <target> PASS|MISS` line per figure.

mod cpu;
mod d1;
mod jetstream;
mod kafka;
mod kinesis;
mod m0;
mod pulsar;
mod pulsar_txn;
mod stats;
mod stores;

/// Benchmark ids, in the order they run when none is named.
const IDS: &[&str] = &["m0", "d1"];

fn main() {
    // onceflow's log on stderr when `RUST_LOG` asks for it (a benchmark prints nothing else).
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let ids: Vec<String> = if args.is_empty() {
        IDS.iter().map(|s| s.to_string()).collect()
    } else {
        args
    };
    for id in ids {
        match id.to_ascii_lowercase().as_str() {
            "d1" => d1::run(),
            "m0" => m0::run(),
            "stores" => stores::run(),
            n @ ("n1" | "n2") => jetstream::run(n),
            k @ ("k1" | "k3" | "k4") => kafka::run(k),
            "p1" => pulsar::run(),
            "p2" => pulsar_txn::run(),
            "ki1" => kinesis::run(),
            other => {
                eprintln!(
                    "unknown benchmark id '{other}': expected one of {}",
                    IDS.join(", ")
                );
                std::process::exit(2);
            }
        }
    }
}
