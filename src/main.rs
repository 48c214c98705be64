//! The `onceflow` command line: `demo`, `produce`, `consume`, `tail`, `lag`, `replay` on any
//! platform URL.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// `println!` that does not panic when standard output is closed (`onceflow demo | head -1`):
/// a line nobody reads any more is dropped, and the command ends as it would have.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

/// `eprintln!` that does not panic when standard error cannot be written (`2>/dev/full`, or
/// `2>&1 | head -1` once the pipe is closed): the exit code stays the command's own.
macro_rules! warn_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

mod cli;
mod demo;

/// onceflow: idempotent consumers and transactional producers on Kafka, Kinesis, Pulsar and
/// NATS JetStream.
#[derive(Parser, Debug)]
#[command(name = "onceflow", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Produce keyed order events, run an exactly-once consume-transform-produce with injected
    /// redeliveries and simulated crashes, and check every input reached the output once.
    Demo(demo::DemoArgs),
    /// Send messages (one per argument or stdin line).
    Produce(cli::ProduceArgs),
    /// Read messages as a member of a consumer group, committing what was printed.
    Consume(cli::ConsumeArgs),
    /// Follow a topic from its end without joining a group's commits.
    Tail(cli::TailArgs),
    /// Show a consumer group's lag per partition.
    Lag(cli::LagArgs),
    /// Re-read a topic from a position or a time, printing it or copying it to another topic.
    Replay(cli::ReplayArgs),
}

/// `--max`: a whole number ≥ 1 (clap's own parser says "invalid digit found in
/// string" for `-5`).
fn positive_count(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err("expected a whole number, 1 or more".into()),
    }
}

/// `onceflow demo --messages`: 1 to [`demo::MAX_MESSAGES`] (the demo checks
/// [`demo::MAX_MEMORY_MESSAGES`] itself on memory://, whose URL the parser does not see).
fn demo_message_count(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(n) if (1..=demo::MAX_MESSAGES).contains(&n) => Ok(n),
        _ => Err(format!(
            "expected a whole number from 1 to {} (at most {} on memory://)",
            demo::MAX_MESSAGES,
            demo::MAX_MEMORY_MESSAGES
        )),
    }
}

/// `--crash-every`: a whole number ≥ 0.
fn count(s: &str) -> Result<u64, String> {
    s.trim()
        .parse::<u64>()
        .map_err(|_| "expected a whole number, 0 or more".to_string())
}

/// `--idempotency-key`: a key that is not empty or blank (it would identify no message; with
/// several messages it would become `-0`, `-1`, … and hide that), as `--topic` and `--group`
/// must not be.
fn idempotency_key(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err("expected a non-empty idempotency key (not only white space)".into());
    }
    Ok(s.to_string())
}

/// `--idle-ms`: milliseconds, a whole number ≥ 0.
fn milliseconds(s: &str) -> Result<u64, String> {
    s.trim()
        .parse::<u64>()
        .map_err(|_| "expected milliseconds, a whole number, 0 or more".to_string())
}

/// `--partitions`: 1 to [`onceflow::MAX_PARTITIONS`] (a platform may hold fewer, which it
/// reports when the topic is created).
fn partition_count(s: &str) -> Result<u32, String> {
    match s.trim().parse::<u32>() {
        Ok(n) if (1..=onceflow::MAX_PARTITIONS).contains(&n) => Ok(n),
        _ => Err(format!(
            "expected a whole number from 1 to {}",
            onceflow::MAX_PARTITIONS
        )),
    }
}

/// What the library logs through `tracing` goes to stderr, so that a user of the command line
/// sees its warnings: a dedup store whose window is shorter than a JetStream stream's
/// duplicate window, a memory store evicting keys still inside their dedup window, a Kafka
/// consumer that could not commit on revocation. `RUST_LOG` chooses what is shown (for example
/// `RUST_LOG=onceflow=debug`, syntax of `tracing_subscriber::EnvFilter`); the default is
/// warnings and errors, except the pulsar crate's "Retry #N -> connecting …" lines, which it logs
/// at WARN for every connection attempt including the first (a failure that matters reaches
/// the user as onceflow's error), and the AWS SDK's "failed to load region from IMDS" off EC2
/// (onceflow's error says what to set). An invalid `RUST_LOG` is reported and the default kept.
fn init_logging() {
    use tracing_subscriber::EnvFilter;
    // The AWS SDK warns, with its internal types, each time instance metadata (IMDS) has no
    // region for it, which is every run off EC2: onceflow's own error says what to set.
    const DEFAULT_LOG: &str = "warn,pulsar::retry_op=error,aws_config::imds=error";
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => EnvFilter::try_new(&v).unwrap_or_else(|e| {
            warn_line!(
                "onceflow: ignoring RUST_LOG={}: {e} (expected directives such as \
                 'warn' or 'onceflow=debug'); showing warnings",
                onceflow::shown(&v)
            );
            EnvFilter::new(DEFAULT_LOG)
        }),
        _ => EnvFilter::new(DEFAULT_LOG),
    };
    let stderr = std::io::stderr();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&stderr))
        .with_target(false)
        .try_init();
}

fn main() -> ExitCode {
    // `--version` names the platforms and stores compiled in, not just the number.
    let version: &'static str = Box::leak(onceflow::version_line().into_boxed_str());
    let parsed = <Cli as clap::CommandFactory>::command()
        .version(version)
        .try_get_matches()
        .and_then(|m| <Cli as clap::FromArgMatches>::from_arg_matches(&m));
    let cli = match parsed {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    init_logging();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            warn_line!("onceflow: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let result = rt.block_on(async move {
        cli::install_signal_handlers();
        match cli.command {
            // Ctrl-C or SIGTERM ends the demo through its own drop path, so its temporary
            // dedup store is removed (a signal's default action would leave it behind).
            Command::Demo(a) => tokio::select! {
                r = demo::run(a) => r,
                code = cli::interrupted() => {
                    warn_line!("onceflow: demo interrupted (its temporary dedup store, if any, is removed)");
                    Ok(ExitCode::from(code))
                }
            },
            Command::Produce(a) => cli::produce(a).await,
            Command::Consume(a) => cli::consume(a).await,
            Command::Tail(a) => cli::tail(a).await,
            Command::Lag(a) => cli::lag(a).await,
            Command::Replay(a) => cli::replay(a).await,
        }
    });
    // Tasks still running (a demo interrupted mid-run) are not waited for.
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    match result {
        Ok(code) => code,
        Err(e) => {
            // The kind in words first: its code (`ONCEFLOW_CONFIG`, ...) reads like an
            // environment variable to someone who has not met it, so it comes last.
            let shown = e.message().to_string();
            warn_line!("onceflow: {}: {shown}", e.kind().describe());
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                // Most messages already end with their cause's text: print only what is new.
                let text = match s.downcast_ref::<onceflow::Error>() {
                    Some(inner) => inner.message().to_string(),
                    None => s.to_string(),
                };
                if !shown.contains(&text) {
                    warn_line!("  caused by: {text}");
                }
                src = s.source();
            }
            warn_line!(
                "  error kind: {} ({})",
                e.kind().code(),
                e.kind().describe()
            );
            // Bad input (config) exits 2, like a usage error; everything else 1.
            if e.kind() == onceflow::ErrorKind::Config
                || e.kind() == onceflow::ErrorKind::Unsupported
            {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}
