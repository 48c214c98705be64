//! Every log line of a test binary, kept in memory: onceflow's and the clients' `tracing`
//! events and `log` records, TRACE and up, for tests that search them for secrets.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();

struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Installs the capturing subscriber (once per binary; later calls do nothing). Panics when
/// another global subscriber was installed first: the capture must see everything.
pub fn capture() {
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = buf.clone();
        tracing_subscriber::fmt()
            .with_max_level(tracing_subscriber::filter::LevelFilter::TRACE)
            .with_ansi(false)
            .with_writer(move || Capture(sink.clone()))
            .try_init()
            .expect("the only subscriber of this test binary");
        buf
    });
}

/// The lines captured so far (empty before [`capture`]).
pub fn captured() -> String {
    LOGS.get()
        .map(|b| String::from_utf8_lossy(&b.lock().unwrap()).into_owned())
        .unwrap_or_default()
}
