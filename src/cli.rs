//! The everyday verbs: produce, consume, tail, lag, replay.

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use onceflow::{
    redact_credentials, Client, Consumer, ConsumerConfig, Error, ErrorKind, Message,
    ProducerConfig, Record, Result, StartFrom,
};

/// Connects to `url` for a command: [`onceflow::connect`], which for `kafka://` and
/// `pulsar://` first checks that a broker answers, so a wrong address fails at once.
pub async fn connect(url: &str) -> Result<Client> {
    tokio::select! {
        r = onceflow::connect(url) => r,
        code = interrupted() => {
            // Nothing is made before the connection: stop at once, as a signal would.
            warn_line!("onceflow: interrupted while connecting");
            std::process::exit(i32::from(code))
        }
    }
}

/// Checks that every topic a command reads exists, so a misspelt name is an error rather than
/// a wait that ends with "0 message(s)".
///
/// Errors: [`ErrorKind::Config`] for an empty name; [`ErrorKind::NotFound`] naming the topic
/// and the URL (credentials removed) when it does not exist.
async fn require_topics(client: &Client, url: &str, topics: &[String]) -> Result<()> {
    for t in topics {
        require_name("--topic", t, "a topic name")?;
    }
    let admin = client.admin().await?;
    for t in topics {
        if let Err(e) = admin.describe_topic(t).await {
            if e.kind() == ErrorKind::NotFound {
                return Err(Error::new(
                    ErrorKind::NotFound,
                    format!(
                        "topic '{}' does not exist on {}: check the name, or create it \
                         (producing to it does on most platforms)",
                        onceflow::shown(t),
                        onceflow::shown(&redact_credentials(url))
                    ),
                ));
            }
            return Err(e);
        }
    }
    Ok(())
}

/// Where to connect.
#[derive(Args, Debug, Clone)]
pub struct Target {
    /// Platform URL: memory://NAME, kafka://HOST:PORT, nats://HOST:PORT, pulsar://…, kinesis://…
    #[arg(
        long,
        env = "ONCEFLOW_URL",
        hide_env_values = true,
        default_value = "memory://"
    )]
    pub url: String,
    /// A setting added to the URL's query, KEY=VALUE (repeatable), e.g.
    /// `-o security.protocol=SASL_SSL -o ssl.ca.location=/etc/ssl/ca.pem`. Prefer ONCEFLOW_URL
    /// for secrets: a command line is visible to other users of the machine.
    #[arg(long = "option", short = 'o', value_name = "KEY=VALUE")]
    pub options: Vec<String>,
}

impl Target {
    /// The URL with the `--option`s added to its query ([`onceflow::url_with_options`]).
    ///
    /// Errors: [`ErrorKind::Config`] for an option without `=` or with an empty key, naming
    /// the key only (its value may be a secret).
    pub fn full_url(&self) -> Result<String> {
        with_options(&self.url, &self.options)
    }
}

/// `url` with `KEY=VALUE` options added to its query; see [`Target::full_url`].
pub fn with_options(url: &str, options: &[String]) -> Result<String> {
    let mut pairs = Vec::with_capacity(options.len());
    for o in options {
        match o.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => pairs.push((k.trim(), v)),
            _ => {
                let key = o.split_once('=').map_or(o.as_str(), |(k, _)| k);
                return Err(Error::config(format!(
                    "invalid --option '{}': expected KEY=VALUE, e.g. -o security.protocol=SASL_SSL",
                    onceflow::shown(if onceflow::is_secret_key(key) {
                        "***"
                    } else {
                        key
                    })
                )));
            }
        }
    }
    onceflow::url_with_options(url, pairs)
}

/// `onceflow produce`
#[derive(Args, Debug)]
pub struct ProduceArgs {
    #[command(flatten)]
    target: Target,
    /// Topic (stream, subject) to write to.
    #[arg(long, short)]
    topic: String,
    /// Message key (selects the partition).
    #[arg(long, short)]
    key: Option<String>,
    /// Header NAME=VALUE; repeat for more (repeated names are kept in order).
    #[arg(long = "header", short = 'H')]
    headers: Vec<String>,
    /// Idempotency key (written to the `idempotency-key` header and used as the platform's
    /// message id where it has one). With several messages, `-N` is appended per message.
    #[arg(long, value_parser = crate::idempotency_key)]
    idempotency_key: Option<String>,
    /// Messages to send; without any, one message per line of standard input (any bytes but
    /// the line end), each sent as it is read (with --idempotency-key, one line is read ahead).
    /// Messages are numbered from 0 (the first line is message 0) in what is reported on
    /// standard error and in the `-N` suffix.
    messages: Vec<String>,
}

/// `onceflow consume`
#[derive(Args, Debug)]
pub struct ConsumeArgs {
    #[command(flatten)]
    target: Target,
    /// Topics to read; repeat for more.
    #[arg(long, short, required = true)]
    topic: Vec<String>,
    /// Consumer group.
    #[arg(long, short)]
    group: String,
    /// Where to start. Without --from: the group's committed position, else the earliest
    /// message (as `--from committed`; `committed-or-latest`: else only new messages). An
    /// explicit earliest, latest, ts:MS_SINCE_EPOCH or position (offset:N, seq:N,
    /// kinesis:DIGITS, pulsar:L:E:P:B) starts every partition there, whatever the group
    /// committed. On NATS JetStream the group's progress is a durable consumer per partition:
    /// an existing durable resumes at its ack floor (with a warning) and the explicit start
    /// applies to new ones only, unless `-o reset=true` deletes and creates it again at the
    /// start (give it to one run only).
    #[arg(long, value_name = "START")]
    from: Option<String>,
    /// Stop after this many messages (at least 1).
    #[arg(long, allow_negative_numbers = true, value_parser = crate::positive_count)]
    max: Option<u64>,
    /// Stop after this long without a message (ms; 0: after the first poll that brings none).
    #[arg(
        long,
        default_value_t = 5000,
        allow_negative_numbers = true,
        value_parser = crate::milliseconds
    )]
    idle_ms: u64,
    /// Print as JSON lines instead of text.
    #[arg(long)]
    json: bool,
}

/// `onceflow tail`
#[derive(Args, Debug)]
pub struct TailArgs {
    #[command(flatten)]
    target: Target,
    /// Topic to follow.
    #[arg(long, short)]
    topic: String,
    /// Stop after this many messages (at least 1).
    #[arg(long, allow_negative_numbers = true, value_parser = crate::positive_count)]
    max: Option<u64>,
    /// Stop after this long without a message (ms); 0 = never.
    #[arg(
        long,
        default_value_t = 0,
        allow_negative_numbers = true,
        value_parser = crate::milliseconds
    )]
    idle_ms: u64,
    /// Print as JSON lines.
    #[arg(long)]
    json: bool,
}

/// `onceflow lag`
#[derive(Args, Debug)]
pub struct LagArgs {
    #[command(flatten)]
    target: Target,
    /// Topic.
    #[arg(long, short)]
    topic: String,
    /// Consumer group.
    #[arg(long, short)]
    group: String,
}

/// `onceflow replay`
#[derive(Args, Debug)]
pub struct ReplayArgs {
    #[command(flatten)]
    target: Target,
    /// Topic to re-read.
    #[arg(long, short)]
    topic: String,
    /// Start: ts:MS_SINCE_EPOCH, earliest, or a position (offset:N, seq:N, …) applied to every
    /// partition.
    #[arg(long)]
    from: String,
    /// Copy the messages to this topic instead of printing them.
    #[arg(long)]
    to_topic: Option<String>,
    /// Stop after this many messages (at least 1).
    #[arg(long, allow_negative_numbers = true, value_parser = crate::positive_count)]
    max: Option<u64>,
    /// Stop after this long without a message (ms; 0: after the first poll that brings none).
    #[arg(
        long,
        default_value_t = 3000,
        allow_negative_numbers = true,
        value_parser = crate::milliseconds
    )]
    idle_ms: u64,
    /// Print as JSON lines.
    #[arg(long)]
    json: bool,
}

/// Parses `--from`: every text form of [`StartFrom`] (its `FromStr`), errors naming the flag.
pub fn parse_start(s: &str) -> Result<StartFrom> {
    s.parse()
        .map_err(|e: Error| Error::config(format!("--from: {}", e.message())))
}

fn parse_header(h: &str) -> Result<(String, String)> {
    match h.split_once('=') {
        Some((n, v)) if !n.is_empty() => Ok((n.to_string(), v.to_string())),
        _ => Err(Error::config(format!(
            "--header '{}': expected NAME=VALUE with a non-empty name",
            onceflow::shown(h)
        ))),
    }
}

/// `onceflow produce`
pub async fn produce(a: ProduceArgs) -> Result<ExitCode> {
    require_name("--topic", &a.topic, "a topic name")?;
    let headers = a
        .headers
        .iter()
        .map(|h| parse_header(h))
        .collect::<Result<Vec<_>>>()?;
    let client = connect(&a.target.full_url()?).await?;
    client.validate_topic(&a.topic)?;
    if client.platform() == "memory" {
        warn_line!(
            "onceflow: note: memory:// is a broker inside this one command; what it sends is \
             gone when the command ends (use a real broker's URL to keep it)"
        );
    }
    let producer = client.producer(ProducerConfig::new()).await?;
    // Lines are read on their own task, so that deliveries are reported while the next line
    // is awaited (`tail -f log | onceflow produce`), and what has already come in is sent
    // together, up to CHUNK records per enqueue and IN_FLIGHT chunks awaiting their
    // acknowledgements: a piped file is not sent one round trip per line.
    const CHUNK: usize = 512;
    const IN_FLIGHT: usize = 8;
    let (lines_tx, mut lines) = tokio::sync::mpsc::channel::<Result<Vec<u8>>>(2 * CHUNK);
    let mut input = Payloads::new(a.messages.clone());
    tokio::spawn(async move {
        loop {
            let next = input.next().await.transpose();
            let end = !matches!(next, Some(Ok(_)));
            if let Some(line) = next {
                if lines_tx.send(line).await.is_err() {
                    return;
                }
            }
            if end {
                return;
            }
        }
    });
    // With an idempotency key, one message is read ahead, to know whether there are several
    // (each then gets its own `-N` suffix).
    let mut ahead = std::collections::VecDeque::new();
    if a.idempotency_key.is_some() {
        for _ in 0..2 {
            if let Some(p) = lines.recv().await {
                ahead.push_back(p?);
            }
        }
    }
    let many = ahead.len() > 1;
    let record = |i: usize, p: Vec<u8>| {
        let mut r = Record::new(a.topic.clone(), p);
        if let Some(k) = &a.key {
            r = r.key(k.clone().into_bytes());
        }
        for (n, v) in &headers {
            r = r.header(n.clone(), v.clone().into_bytes());
        }
        if let Some(id) = &a.idempotency_key {
            r = r.idempotency_key(if many {
                format!("{id}-{i}")
            } else {
                id.clone()
            });
        }
        r
    };
    let mut out = std::io::stdout().lock();
    let mut failed = 0;
    let mut bad_input = false;
    // A send that failed for another reason than its record (after the producer's own
    // retries: the broker is gone, the network is cut) stops the reading; what was sent is
    // still reported. Reading on would fail every later line the same way, one publish
    // timeout after another, for as long as the input lasts (#28).
    let mut platform_failed = false;
    let mut report = |first: usize, results: Vec<Result<onceflow::Delivery>>| -> bool {
        for (i, result) in (first..).zip(results) {
            match result {
                Ok(d) => {
                    let _ = writeln!(
                        out,
                        "{}[{}] {}{}",
                        d.topic,
                        d.partition,
                        d.position,
                        match (d.duplicate, d.attempts) {
                            (false, _) => "",
                            (true, 1) => " (duplicate)",
                            // The copy the platform holds may be this send's own earlier
                            // attempt, whose acknowledgement was lost (#28).
                            (true, _) => {
                                " (already stored: by an earlier attempt of this send, or an \
                                 earlier send of its key)"
                            }
                        }
                    );
                }
                Err(e) => {
                    failed += 1;
                    // A timed-out send may have been written (the acknowledgement was lost or
                    // late): saying "not sent" would have the user send it again (#28).
                    let what = if e.outcome_unknown() {
                        "outcome unknown (it may have been written)"
                    } else {
                        "not sent"
                    };
                    warn_line!(
                        "onceflow: message {i} {what}: {}: {}\n  error kind: {} ({})",
                        e.kind().describe(),
                        e.message(),
                        e.kind().code(),
                        e.kind().describe()
                    );
                    bad_input |= e.kind() == ErrorKind::Config;
                    platform_failed |= e.kind() != ErrorKind::Config;
                }
            }
        }
        platform_failed
    };
    let mut sent = 0usize;
    let mut in_flight: std::collections::VecDeque<(usize, onceflow::backend::DeliveriesFuture)> =
        std::collections::VecDeque::new();
    let mut input_open = true;
    // A signal stops the reading; what was read is still sent and reported (a second signal
    // exits at once).
    let stop = interrupted();
    tokio::pin!(stop);
    let mut stopped = None;
    while input_open || !in_flight.is_empty() {
        let chunk = if !ahead.is_empty() {
            Some(ahead.drain(..).map(Ok).collect::<Vec<_>>())
        } else {
            tokio::select! {
                biased;
                results = async { in_flight.front_mut().expect("not empty").1.as_mut().await },
                    if !in_flight.is_empty() =>
                {
                    let (first, _) = in_flight.pop_front().expect("not empty");
                    if report(first, results) && input_open {
                        input_open = false;
                        warn_line!(
                            "onceflow: stopped reading after a failed send: messages from {sent} \
                             on were not sent"
                        );
                    }
                    None
                }
                code = &mut stop, if stopped.is_none() => {
                    stopped = Some(code);
                    input_open = false;
                    if !in_flight.is_empty() {
                        say_interrupted_while_sending();
                    }
                    None
                }
                line = lines.recv(), if input_open && in_flight.len() < IN_FLIGHT => {
                    match line {
                        None => {
                            input_open = false;
                            None
                        }
                        Some(line) => {
                            let mut chunk = vec![line];
                            while chunk.len() < CHUNK {
                                match lines.try_recv() {
                                    Ok(line) => chunk.push(line),
                                    Err(_) => break,
                                }
                            }
                            Some(chunk)
                        }
                    }
                }
            }
        };
        let Some(chunk) = chunk else { continue };
        let mut records = Vec::with_capacity(chunk.len());
        let mut read_error = None;
        for line in chunk {
            match line {
                Ok(p) => records.push(record(sent + records.len(), p)),
                Err(e) => {
                    read_error = Some(e);
                    break;
                }
            }
        }
        let n = records.len();
        if n > 0 {
            // Platforms other than Kafka send the chunk before `enqueue_batch` returns: a
            // signal meanwhile is said at once, and the chunk still ends and is reported.
            let enqueue = producer.enqueue_batch(records);
            tokio::pin!(enqueue);
            let deliveries = loop {
                tokio::select! {
                    deliveries = &mut enqueue => break deliveries,
                    code = &mut stop, if stopped.is_none() => {
                        stopped = Some(code);
                        input_open = false;
                        say_interrupted_while_sending();
                    }
                }
            };
            in_flight.push_back((sent, deliveries));
            sent += n;
        }
        if let Some(e) = read_error {
            // What was read before the error is still sent and reported.
            while let Some((first, deliveries)) = in_flight.pop_front() {
                report(first, deliveries.await);
            }
            return Err(e);
        }
    }
    if stopped.is_some() {
        // Lines read but not handed over, and those never read, are nowhere else named.
        warn_line!("onceflow: interrupted: stopped reading; messages from {sent} on were not sent");
    } else if sent == 0 && failed == 0 {
        // Each message sent is reported on a line of its own: with none, say so.
        warn_line!("onceflow: standard input had no lines: nothing was sent");
    }
    // Every message sent has its report by now; the flush is what the producer may still
    // hold besides. After a failure of the platform itself it could only wait its timeout.
    if !platform_failed {
        producer.flush(Duration::from_secs(30)).await?;
    }
    if let (Some(code), 0) = (stopped, failed) {
        // The reader of standard input may still wait for a line it cannot be cancelled out
        // of: do not make the runtime's shutdown wait for it.
        let _ = out.flush();
        std::process::exit(i32::from(code));
    }
    // Like every other command: bad input exits 2, any other failure 1.
    Ok(match failed {
        0 => ExitCode::SUCCESS,
        _ if bad_input => ExitCode::from(2),
        _ => ExitCode::from(1),
    })
}

/// What `produce` says when a signal comes while messages it sent await their acknowledgements.
fn say_interrupted_while_sending() {
    warn_line!(
        "onceflow: interrupted: waiting for the acknowledgements of the messages already sent \
         (again to stop at once)"
    );
}

/// What `produce` sends: its arguments, or each line of standard input as it is read (without
/// the line end; any bytes, not only UTF-8).
enum Payloads {
    Args(std::vec::IntoIter<String>),
    Stdin(tokio::io::BufReader<tokio::io::Stdin>),
}

impl Payloads {
    fn new(messages: Vec<String>) -> Self {
        if messages.is_empty() {
            Payloads::Stdin(tokio::io::BufReader::new(tokio::io::stdin()))
        } else {
            Payloads::Args(messages.into_iter())
        }
    }

    async fn next(&mut self) -> Result<Option<Vec<u8>>> {
        use tokio::io::AsyncBufReadExt as _;
        match self {
            Payloads::Args(it) => Ok(it.next().map(String::into_bytes)),
            Payloads::Stdin(r) => {
                let mut line = Vec::new();
                let n = r
                    .read_until(b'\n', &mut line)
                    .await
                    .map_err(|e| Error::config("cannot read standard input").with_source(e))?;
                if n == 0 {
                    return Ok(None);
                }
                if line.last() == Some(&b'\n') {
                    line.pop();
                    if line.last() == Some(&b'\r') {
                        line.pop();
                    }
                }
                Ok(Some(line))
            }
        }
    }
}

/// Writes one message to `out` (a line of text or JSON). A failed write (a closed pipe, a
/// full disk) is [`ErrorKind::Closed`]: the command stops and commits only what was written.
fn print_message(out: &mut impl Write, m: &Message, json: bool) -> Result<()> {
    if json {
        let headers: Vec<serde_json::Value> = m
            .headers
            .iter()
            .map(|h| {
                serde_json::json!([
                    h.name,
                    h.value
                        .as_ref()
                        .map(|v| String::from_utf8_lossy(v).into_owned())
                ])
            })
            .collect();
        let v = serde_json::json!({
            "topic": m.topic,
            "partition": m.partition,
            "position": m.position.to_string(),
            "key": m.key.as_ref().map(|k| String::from_utf8_lossy(k).into_owned()),
            "payload": String::from_utf8_lossy(&m.payload),
            "headers": headers,
            "timestamp": m.timestamp,
        });
        writeln!(out, "{v}")
    } else {
        let key = m
            .key
            .as_ref()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .unwrap_or_default();
        writeln!(
            out,
            "{}[{}] {} key={} {}",
            m.topic,
            m.partition,
            m.position,
            key,
            String::from_utf8_lossy(&m.payload)
        )
    }
    .map_err(stdout_failed)
}

/// A failed write to standard output: [`ErrorKind::Closed`], the command stops.
fn stdout_failed(e: std::io::Error) -> Error {
    Error::new(
        ErrorKind::Closed,
        format!("cannot write to standard output ({e}); stopped"),
    )
    .with_source(e)
}

/// [`ErrorKind::Config`] when the value of `flag` is empty or blank, naming `what` it should be.
fn require_name(flag: &str, value: &str, what: &str) -> Result<()> {
    if value.trim().is_empty() {
        return Err(Error::config(format!(
            "{flag} '{value}': expected {what}, not an empty one"
        )));
    }
    Ok(())
}

/// The signal that asked the process to stop (its exit status), once one came.
static STOP: std::sync::OnceLock<tokio::sync::watch::Sender<Option<u8>>> =
    std::sync::OnceLock::new();
/// How many [`interrupted`] futures are waiting: while none is, a signal ends the process at
/// once, as its default action would.
static LISTENING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn stop_channel() -> &'static tokio::sync::watch::Sender<Option<u8>> {
    STOP.get_or_init(|| tokio::sync::watch::channel(None).0)
}

/// Installs the process's handlers for Ctrl-C (SIGINT), SIGTERM and SIGHUP, once, at start
/// (inside the runtime). Once installed, the operating system no longer ends the process on
/// these signals, so the handler does: a signal that comes while a command waits in
/// [`interrupted`] stops that command gracefully; one that comes while nothing waits (a
/// `produce` reading standard input, a consumer joining its group) exits at once with the
/// shell's status for it, 128 + its number (130, 143, 129).
pub fn install_signal_handlers() {
    let tx = stop_channel().clone();
    tokio::spawn(async move {
        let code = signalled().await;
        if LISTENING.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            std::process::exit(i32::from(code));
        }
        let _ = tx.send(Some(code));
        // A second signal while the command is stopping: do not wait for it any longer.
        let code = signalled().await;
        std::process::exit(i32::from(code));
    });
}

/// The next Ctrl-C, SIGTERM or SIGHUP, as its exit status.
async fn signalled() -> u8 {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        async fn on(kind: SignalKind) {
            match signal(kind) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending().await,
            }
        }
        tokio::select! {
            _ = tokio::signal::ctrl_c() => 130,
            _ = on(SignalKind::terminate()) => 143,
            _ = on(SignalKind::hangup()) => 129,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        130
    }
}

/// Resolves when Ctrl-C (SIGINT), SIGTERM or SIGHUP asks the process to stop — how a
/// terminal, `timeout`, a service manager or a closed terminal does it — with the shell's exit
/// status for that signal: 128 + its number (130, 143, 129). Needs
/// [`install_signal_handlers`]; while this future exists, a signal is the caller's to handle
/// (without it, the process exits at once).
pub async fn interrupted() -> u8 {
    struct Listening;
    impl Drop for Listening {
        fn drop(&mut self) {
            LISTENING.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    LISTENING.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let _listening = Listening;
    let mut rx = stop_channel().subscribe();
    let code = match rx.wait_for(Option::is_some).await {
        Ok(code) => code.unwrap_or(130),
        Err(_) => std::future::pending().await,
    };
    code
}

/// The exit status of a read command: success, or the signal's status if one stopped it.
fn exit_status(stopped: Option<u8>) -> ExitCode {
    stopped.map_or(ExitCode::SUCCESS, ExitCode::from)
}

/// How long `--idle-ms` waits for partitions to be assigned before it starts counting.
const ASSIGNMENT_GRACE: Duration = Duration::from_secs(10);

/// The shortest idle wait before a command's first message.
const FIRST_FETCH: Duration = Duration::from_secs(3);

/// Positions to commit: each partition's last message handled.
type Positions = Vec<(onceflow::TopicPartition, onceflow::Position)>;

/// Polls until `max` messages, `idle` without one, or an interrupt; returns how many were
/// read and, if a signal ended the loop, its exit status (what was handed to `each` stays
/// handled). When `each` returns positions, they are committed before the next poll.
async fn read_loop(
    consumer: &Consumer,
    max: Option<u64>,
    idle: Option<Duration>,
    mut each: impl FnMut(&[Message]) -> Result<Option<Positions>>,
) -> Result<(u64, Option<u8>)> {
    let mut n = 0u64;
    let started = Instant::now();
    let mut last = started;
    let mut stop = std::pin::pin!(interrupted());
    loop {
        let want = max.map(|m| (m - n).min(500) as usize).unwrap_or(500);
        if want == 0 {
            break;
        }
        let batch = tokio::select! {
            biased;
            code = &mut stop => return Ok((n, Some(code))),
            b = consumer.poll(want, Duration::from_millis(200)) => b?,
        };
        if batch.is_empty() {
            // The idle clock starts once partitions are assigned (joining a group or
            // subscribing takes a while on some platforms), or after a grace period for a
            // member that gets none.
            if consumer.assignment().is_empty() && started.elapsed() < ASSIGNMENT_GRACE {
                last = Instant::now();
                continue;
            }
            // Before the first message, at least FIRST_FETCH: a Pulsar consumer is assigned
            // its partitions at once but receives its first messages about 1 s later.
            let wait = if n == 0 {
                idle.map(|i| i.max(FIRST_FETCH))
            } else {
                idle
            };
            if wait.is_some_and(|i| last.elapsed() >= i) {
                break;
            }
            continue;
        }
        last = Instant::now();
        n += batch.len() as u64;
        if let Some(done) = each(&batch)? {
            consumer.commit(&done).await?;
        }
    }
    Ok((n, None))
}

/// `onceflow consume`
pub async fn consume(a: ConsumeArgs) -> Result<ExitCode> {
    // What the user typed reaches the platform as it is: an explicit start is explicit (on
    // JetStream the one that `-o reset=true` resets a durable to), only the default is
    // committed-with-fallback.
    let start = match &a.from {
        Some(from) => parse_start(from)?,
        None => StartFrom::committed_or_earliest(),
    };
    require_name("--group", &a.group, "a consumer group name")?;
    let client = connect(&a.target.full_url()?).await?;
    require_topics(&client, &a.target.url, &a.topic).await?;
    if client.platform() == "kinesis" && !a.target.url.contains("checkpoint_store=") {
        warn_line!(
            "onceflow: note: without checkpoint_store= in the kinesis:// URL the group's \
             checkpoints live in this command only: the next run starts again from --from"
        );
    }
    let consumer = client
        .consumer(ConsumerConfig::new(a.group.clone(), a.topic.clone()).start(start))
        .await?;
    let mut out = std::io::stdout().lock();
    let mut to_commit = Vec::new();
    let n = read_loop(
        &consumer,
        a.max,
        Some(Duration::from_millis(a.idle_ms)),
        |batch| {
            for m in batch {
                print_message(&mut out, m, a.json)?;
                // Every partition written so far, not only the last batch's.
                let tp = m.topic_partition();
                match to_commit.iter_mut().find(|(t, _)| *t == tp) {
                    Some((_, q)) => *q = m.position.clone(),
                    None => to_commit.push((tp, m.position.clone())),
                }
            }
            // Written out before committed, batch by batch: a crash or SIGKILL prints again
            // at most this batch, never what an earlier batch printed.
            out.flush().map_err(stdout_failed)?;
            Ok(Some(to_commit.clone()))
        },
    )
    .await;
    // Commit what was printed (also after Ctrl-C: each batch is committed once written, this
    // is the last one's, again), then leave the group.
    if !to_commit.is_empty() {
        consumer.commit(&to_commit).await?;
    }
    if n.as_ref().is_ok_and(|(_, stopped)| stopped.is_none()) {
        // Read to the end: also past transaction markers and aborted records after the last
        // message (or instead of any message), or `onceflow lag` shows 1 or more for ever.
        consumer.commit_skipped().await?;
    }
    let (n, stopped) = n?;
    if n == 0 && stopped.is_none() && consumer.assignment().is_empty() {
        // Not "nothing to read": this member read nothing because it was given nothing.
        warn_line!(
            "onceflow: no partition of {} was assigned to this member of group '{}' within {} s: \
             other members hold them all, or the group is still rebalancing",
            a.topic.join(", "),
            a.group,
            ASSIGNMENT_GRACE.as_secs()
        );
    }
    consumer.close().await?;
    warn_line!(
        "onceflow: {n} message(s) read and committed for group '{}'{}",
        a.group,
        if stopped.is_some() {
            " (interrupted)"
        } else {
            ""
        }
    );
    Ok(exit_status(stopped))
}

fn scratch_group(what: &str) -> String {
    format!("onceflow-{what}-{:08x}", rand::random::<u32>())
}

/// `onceflow tail`
pub async fn tail(a: TailArgs) -> Result<ExitCode> {
    let client = connect(&a.target.full_url()?).await?;
    require_topics(&client, &a.target.url, std::slice::from_ref(&a.topic)).await?;
    let consumer = client
        .consumer(
            ConsumerConfig::new(scratch_group("tail"), [a.topic.clone()]).start(StartFrom::Latest),
        )
        .await?;
    let mut out = std::io::stdout().lock();
    let idle = (a.idle_ms > 0).then(|| Duration::from_millis(a.idle_ms));
    let (_, stopped) = read_loop(&consumer, a.max, idle, |batch| {
        for m in batch {
            print_message(&mut out, m, a.json)?;
        }
        out.flush().map_err(stdout_failed)?;
        Ok(None)
    })
    .await?;
    consumer.close().await?;
    Ok(exit_status(stopped))
}

/// `onceflow lag`
pub async fn lag(a: LagArgs) -> Result<ExitCode> {
    require_name("--group", &a.group, "a consumer group name")?;
    let client = connect(&a.target.full_url()?).await?;
    require_topics(&client, &a.target.url, std::slice::from_ref(&a.topic)).await?;
    let admin = client.admin().await?;
    let lag = admin.group_lag(&a.group, &a.topic).await?;
    say!(
        "{:<40} {:>24} {:>24} {:>10}",
        "PARTITION",
        "COMMITTED",
        "END",
        "LAG"
    );
    let mut total = 0u64;
    for l in &lag {
        total += l.messages;
        say!(
            "{:<40} {:>24} {:>24} {:>10}",
            l.partition.to_string(),
            l.committed
                .as_ref()
                .map(|p| p.to_string())
                .unwrap_or_else(|| "-".into()),
            l.high_watermark
                .as_ref()
                .map(|p| p.to_string())
                .unwrap_or_else(|| "-".into()),
            l.messages
        );
    }
    say!(
        "total lag for group '{}' on '{}': {total} message(s)",
        a.group,
        a.topic
    );
    Ok(ExitCode::SUCCESS)
}

/// `onceflow replay`
pub async fn replay(a: ReplayArgs) -> Result<ExitCode> {
    let start = match parse_start(&a.from) {
        Ok(StartFrom::Earliest) => StartFrom::Earliest,
        Ok(s @ (StartFrom::Timestamp(_) | StartFrom::Position(_))) => s,
        // A bad timestamp: its own error says so.
        Err(e) if a.from.starts_with("ts:") || a.from.starts_with("timestamp:") => return Err(e),
        // `committed` and `latest` name no past to replay.
        _ => {
            return Err(Error::config(format!(
                "--from '{}': replay expects earliest, ts:MILLISECONDS_SINCE_EPOCH or a position \
                 (offset:N, seq:N, kinesis:DIGITS, pulsar:L:E:P:B)",
                onceflow::shown(&a.from)
            )))
        }
    };
    if let Some(t) = &a.to_topic {
        require_name("--to-topic", t, "a topic name")?;
        if *t == a.topic {
            return Err(Error::config(format!(
                "--to-topic '{}' is the topic being replayed: expected another topic (a copy \
                 into itself doubles what it reads)",
                onceflow::shown(t)
            )));
        }
    }
    let client = connect(&a.target.full_url()?).await?;
    if let Some(t) = &a.to_topic {
        client.validate_topic(t)?;
    }
    require_topics(&client, &a.target.url, std::slice::from_ref(&a.topic)).await?;
    let consumer = client
        .consumer(ConsumerConfig::new(scratch_group("replay"), [a.topic.clone()]).start(start))
        .await?;
    let producer = match &a.to_topic {
        Some(_) => Some(client.producer(ProducerConfig::new()).await?),
        None => None,
    };
    let mut out = std::io::stdout().lock();
    let mut copies: Vec<Record> = Vec::new();
    let (n, stopped) = read_loop(
        &consumer,
        a.max,
        Some(Duration::from_millis(a.idle_ms)),
        |batch| {
            for m in batch {
                match &a.to_topic {
                    Some(t) => copies.push(Record {
                        topic: t.clone(),
                        key: m.key.clone(),
                        payload: m.payload.clone(),
                        headers: m.headers.clone(),
                        ..Default::default()
                    }),
                    None => print_message(&mut out, m, a.json)?,
                }
            }
            Ok(None)
        },
    )
    .await?;
    if let Some(p) = producer {
        let to = a.to_topic.unwrap_or_default();
        let mut refused = 0;
        let mut first = None;
        for r in p.send_batch(std::mem::take(&mut copies)).await {
            if let Err(e) = r {
                refused += 1;
                first.get_or_insert(e);
            }
        }
        p.flush(Duration::from_secs(30)).await?;
        if let Some(e) = first {
            consumer.close().await?;
            // Every refusal would be the same story: the count, and the first one's reason.
            return Err(Error::new(
                e.kind(),
                format!(
                    "replayed {} of {n} message(s) into '{to}': {refused} refused, the first: {}",
                    n as usize - refused,
                    e.message()
                ),
            ));
        }
        warn_line!("onceflow: replayed {n} message(s) into '{to}'");
    }
    consumer.close().await?;
    Ok(exit_status(stopped))
}
