//! The engine from JavaScript: `IdempotentConsumer` and `Pipeline`, with a JavaScript function
//! as the [`Handler`] / [`Transform`]. The function is called on the event loop through a
//! ThreadsafeFunction and returns a Promise; the engine awaits it from the tokio runtime.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use napi::bindgen_prelude::{Buffer, Function, Object, Promise, Result};
use napi::threadsafe_function::ThreadsafeFunction;
use napi::Status;
use napi_derive::napi;
use onceflow::{
    BoxError, Error, ErrorKind, Handler, Record, RunSummary as RsRunSummary, Transform,
    TransformOutput,
};
use onceflow_bindings::settings::{self, Language, OwnNames};

use crate::client::{Consumer, DedupStore, Producer};
use crate::convert::{self, Message, RecordIn};
use crate::{js_err, on_rt};

/// A weak ThreadsafeFunction (it does not keep the process alive) taking a message and
/// returning a Promise.
type JsFn<R> = ThreadsafeFunction<Message, Promise<R>, Message, Status, false, true>;

/// The text of a rejection, as the handler error's cause.
pub(crate) fn rejected(e: napi::Error) -> BoxError {
    let text = if e.reason.is_empty() {
        e.status.to_string()
    } else {
        e.reason.clone()
    };
    text.into()
}

async fn call<R: napi::bindgen_prelude::FromNapiValue + Send + 'static>(
    f: &JsFn<R>,
    m: &onceflow::Message,
) -> std::result::Result<R, BoxError> {
    let p = f.call_async(Message::from(m)).await.map_err(rejected)?;
    p.await.map_err(rejected)
}

struct JsHandler(JsFn<Option<Buffer>>);

#[async_trait]
impl Handler for JsHandler {
    async fn handle(&self, m: &onceflow::Message) -> std::result::Result<Option<Bytes>, BoxError> {
        let out = call(&self.0, m).await?;
        Ok(out.map(|b| Bytes::copy_from_slice(b.as_ref())))
    }
}

/// What a pipeline's transform resolves to, as `index.js` hands it over.
#[napi(object)]
pub struct TransformOut {
    /// The output records (absent: none).
    pub records: Option<Vec<RecordIn>>,
    /// The W3C trace headers (`traceparent`, `tracestate`, `baggage`) of the span the
    /// transform ran in (the JavaScript `process` span): the outputs are sent as its children.
    /// Absent: they are children of the core's process span.
    pub parent: Option<Vec<convert::Header>>,
}

struct JsTransform(JsFn<Option<TransformOut>>);

#[async_trait]
impl Transform for JsTransform {
    async fn transform(&self, m: &onceflow::Message) -> std::result::Result<Vec<Record>, BoxError> {
        Ok(self.transform_traced(m).await?.records)
    }

    async fn transform_traced(
        &self,
        m: &onceflow::Message,
    ) -> std::result::Result<TransformOutput, BoxError> {
        let Some(out) = call(&self.0, m).await? else {
            return Ok(TransformOutput::default());
        };
        Ok(TransformOutput {
            records: out
                .records
                .unwrap_or_default()
                .into_iter()
                .map(convert::record)
                .collect(),
            parent: out
                .parent
                .and_then(|h| onceflow::trace::extract_parent(&convert::headers(Some(h)))),
        })
    }
}

/// Engine counters.
#[napi(object)]
pub struct Metrics {
    /// Messages received (redeliveries included).
    pub consumed: f64,
    /// Messages whose handler ran to success.
    pub processed: f64,
    /// Messages skipped as duplicates.
    pub duplicates_skipped: f64,
    /// Handler invocations that failed.
    pub handler_errors: f64,
    /// Handler retries.
    pub retries: f64,
    /// Messages dead-lettered.
    pub dead_lettered: f64,
    /// Messages handed back for redelivery.
    pub redelivery_requests: f64,
    /// Transactions committed.
    pub transactions_committed: f64,
    /// Transactions aborted.
    pub transactions_aborted: f64,
    /// Assignment changes seen.
    pub rebalances: f64,
    /// Work refused because this worker was fenced.
    pub fenced: f64,
    /// Position commits sent.
    pub commits: f64,
    /// Records produced by a pipeline.
    pub produced: f64,
    /// Messages whose `traceparent` header was malformed and ignored (W3C Trace Context §3.2);
    /// also exported as the OpenTelemetry counter `onceflow.malformed_traceparents`.
    pub malformed_traceparents: f64,
    /// Messages handled without an idempotency key although a dedup store was set
    /// (at-least-once, no dedup record); also the OpenTelemetry counter `onceflow.keyless`.
    pub keyless: f64,
}

impl From<onceflow::MetricsSnapshot> for Metrics {
    fn from(m: onceflow::MetricsSnapshot) -> Self {
        Metrics {
            consumed: m.consumed as f64,
            processed: m.processed as f64,
            duplicates_skipped: m.duplicates_skipped as f64,
            handler_errors: m.handler_errors as f64,
            retries: m.retries as f64,
            dead_lettered: m.dead_lettered as f64,
            redelivery_requests: m.redelivery_requests as f64,
            transactions_committed: m.transactions_committed as f64,
            transactions_aborted: m.transactions_aborted as f64,
            rebalances: m.rebalances as f64,
            fenced: m.fenced as f64,
            commits: m.commits as f64,
            produced: m.produced as f64,
            malformed_traceparents: m.malformed_traceparents as f64,
            keyless: m.keyless as f64,
        }
    }
}

/// What a run ends with.
#[napi(object)]
pub struct RunSummary {
    /// Counters at the end of the run.
    pub metrics: Metrics,
    /// The guarantee the run had.
    pub guarantee: String,
    /// Whether shutdown finished all work in flight before its deadline.
    pub drained: bool,
}

impl From<RsRunSummary> for RunSummary {
    fn from(s: RsRunSummary) -> Self {
        RunSummary {
            metrics: s.metrics.into(),
            guarantee: s.guarantee.to_string(),
            drained: s.drained,
        }
    }
}

fn already_ran() -> Error {
    Error::new(
        ErrorKind::Closed,
        "this engine already ran: create a new one",
    )
}

type Stop = tokio::sync::watch::Sender<bool>;

async fn stopped(mut rx: tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// The options `index.js` takes out of an `IdempotentConsumer`'s options object before the
/// rest reach the settings table: named in its error about an unknown option.
const IDEMPOTENT_OWN: OwnNames<'static> = &["store", "windowMs", "deadLetterProducer"];

/// The same for a `Pipeline`.
const PIPELINE_OWN: OwnNames<'static> = &["store", "windowMs"];

/// A settings-table error as JavaScript sees it: a config error, without the marker source
/// that tells Python to raise a `TypeError` (it would show as a `cause`).
fn settings_err(e: Error) -> napi::Error {
    js_err(&Error::config(e.message()))
}

/// At-least-once consumption plus a dedup store: the handler runs once per idempotency key.
#[napi(js_name = "NativeIdempotentConsumer")]
pub struct IdempotentConsumer {
    engine: Arc<tokio::sync::Mutex<Option<onceflow::IdempotentConsumer>>>,
    metrics: onceflow::Metrics,
    guarantee: String,
    stop: Stop,
}

#[napi]
impl IdempotentConsumer {
    /// `handler(message)` returns a Promise of a Buffer (kept as the result of the key) or
    /// null. Without a store, delivery is at-least-once.
    #[napi(constructor)]
    pub fn new(
        consumer: &Consumer,
        #[napi(ts_arg_type = "(message: Message) => Promise<Buffer | null | undefined>")]
        handler: Function<Message, Promise<Option<Buffer>>>,
        store: Option<&DedupStore>,
        #[napi(ts_arg_type = "EngineOptions")] options: Option<Object>,
        dead_letter_producer: Option<&Producer>,
    ) -> Result<Self> {
        let config = settings::engine_config(
            Language::Node,
            convert::settings(options.as_ref())?,
            IDEMPOTENT_OWN,
        )
        .map_err(settings_err)?;
        let f = handler
            .build_threadsafe_function::<Message>()
            .weak::<true>()
            .build()?;
        let engine = onceflow::IdempotentConsumer::with_config(
            consumer.inner.clone(),
            store.map(|s| s.inner.clone()),
            Arc::new(JsHandler(f)),
            config,
            dead_letter_producer.map(|p| p.inner.clone()),
        )
        .map_err(|e| js_err(&e))?;
        Ok(IdempotentConsumer {
            metrics: engine.metrics(),
            guarantee: engine.guarantee().to_string(),
            engine: Arc::new(tokio::sync::Mutex::new(Some(engine))),
            stop: tokio::sync::watch::channel(false).0,
        })
    }

    /// `effectively-once` with a store, `at-least-once` without.
    #[napi(getter)]
    pub fn guarantee(&self) -> String {
        self.guarantee.clone()
    }

    /// Counters, live.
    #[napi]
    pub fn metrics(&self) -> Metrics {
        self.metrics.snapshot().into()
    }

    /// Polls once and handles what arrived; resolves to the number of messages polled.
    #[napi]
    pub async fn step(&self) -> Result<u32> {
        let engine = self.engine.clone();
        on_rt(async move {
            let guard = engine.lock().await;
            guard.as_ref().ok_or_else(already_ran)?.step().await
        })
        .await
        .map(|n| n as u32)
    }

    /// Runs until `stop()` or an error, then drains, commits and closes the consumer.
    #[napi]
    pub async fn run(&self) -> Result<RunSummary> {
        let engine = self.engine.clone();
        let rx = self.stop.subscribe();
        on_rt(async move {
            let ic = engine.lock().await.take().ok_or_else(already_ran)?;
            ic.run_until(stopped(rx)).await
        })
        .await
        .map(RunSummary::from)
    }

    /// Asks a running `run()` to stop: it finishes work in flight, commits and resolves.
    #[napi]
    pub fn stop(&self) {
        self.stop.send_replace(true);
    }
}

/// Consume-transform-produce with the strongest mechanism the platform offers.
#[napi(js_name = "NativePipeline")]
pub struct Pipeline {
    engine: Arc<tokio::sync::Mutex<Option<onceflow::Pipeline>>>,
    metrics: onceflow::Metrics,
    guarantee: String,
    mechanism: String,
    stop: Stop,
}

#[napi]
impl Pipeline {
    /// `transform(message)` returns a Promise of a `TransformOut` (null or undefined: no output):
    /// `records`, the records to write, and `parent`, the W3C trace headers of the span they
    /// are children of. A field with nothing in it is left out (undefined), never null: napi
    /// reads a null field as an array of the wrong type and the transform fails.
    #[napi(constructor)]
    pub fn new(
        consumer: &Consumer,
        producer: &Producer,
        #[napi(ts_arg_type = "(message: Message) => Promise<TransformOut | null | undefined>")]
        transform: Function<Message, Promise<Option<TransformOut>>>,
        store: Option<&DedupStore>,
        #[napi(ts_arg_type = "PipelineOptions")] options: Option<Object>,
    ) -> Result<Self> {
        let pc = settings::pipeline_config(
            Language::Node,
            convert::settings(options.as_ref())?,
            PIPELINE_OWN,
        )
        .map_err(settings_err)?;
        let f = transform
            .build_threadsafe_function::<Message>()
            .weak::<true>()
            .build()?;
        let p = onceflow::Pipeline::with_config(
            consumer.inner.clone(),
            producer.inner.clone(),
            store.map(|s| s.inner.clone()),
            Arc::new(JsTransform(f)),
            pc,
        )
        .map_err(|e| js_err(&e))?;
        Ok(Pipeline {
            metrics: p.metrics(),
            guarantee: p.guarantee().to_string(),
            mechanism: p.mechanism().to_string(),
            engine: Arc::new(tokio::sync::Mutex::new(Some(p))),
            stop: tokio::sync::watch::channel(false).0,
        })
    }

    /// The guarantee this pipeline runs with.
    #[napi(getter)]
    pub fn guarantee(&self) -> String {
        self.guarantee.clone()
    }

    /// The mechanism, in words.
    #[napi(getter)]
    pub fn mechanism(&self) -> String {
        self.mechanism.clone()
    }

    /// Counters, live.
    #[napi]
    pub fn metrics(&self) -> Metrics {
        self.metrics.snapshot().into()
    }

    /// Runs until `stop()` or an error.
    #[napi]
    pub async fn run(&self) -> Result<RunSummary> {
        let engine = self.engine.clone();
        let rx = self.stop.subscribe();
        on_rt(async move {
            let p = engine.lock().await.take().ok_or_else(already_ran)?;
            p.run_until(stopped(rx)).await
        })
        .await
        .map(RunSummary::from)
    }

    /// Asks a running `run()` to stop.
    #[napi]
    pub fn stop(&self) {
        self.stop.send_replace(true);
    }
}
