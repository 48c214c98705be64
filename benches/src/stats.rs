//! Small statistics shared by the benchmarks.

/// The median of `v` (the mean of the two middle values for an even count). `v` must not be
/// empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}
