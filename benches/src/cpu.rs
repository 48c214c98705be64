//! CPU time of this process, for verdicts that must not move when other processes load the
//! machine.

use std::time::Duration;

/// CPU time (user + system, all threads) this process has used so far, with nanosecond
/// resolution (`clock_gettime(CLOCK_PROCESS_CPUTIME_ID)` through the `cpu-time` crate;
/// `/proc/self/stat` counts 10 ms ticks, too coarse for runs of a few hundred ms).
pub fn process_cpu() -> Duration {
    cpu_time::ProcessTime::now().as_duration()
}
