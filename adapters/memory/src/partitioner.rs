//! Kafka's default partitioner for keyed records: `toPositive(murmur2(key)) % partitions`
//! (`org.apache.kafka.clients.producer.internals.BuiltInPartitioner`), so a key lands on the
//! partition it would on Kafka with the Java client.

/// Kafka's murmur2 (`org.apache.kafka.common.utils.Utils.murmur2`), seed `0x9747b28c`.
pub fn murmur2(data: &[u8]) -> i32 {
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len();
    let mut h: u32 = 0x9747_b28c ^ (len as u32);
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    if tail.len() >= 3 {
        h ^= (tail[2] as u32) << 16;
    }
    if tail.len() >= 2 {
        h ^= (tail[1] as u32) << 8;
    }
    if !tail.is_empty() {
        h ^= tail[0] as u32;
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition Kafka's default partitioner picks for `key` among `partitions`.
pub fn partition_for_key(key: &[u8], partitions: u32) -> i32 {
    ((murmur2(key) & 0x7fff_ffff) as u32 % partitions) as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_kafka_murmur2_vectors() {
        // Vectors from Kafka's UtilsTest.testMurmur2.
        let cases: [(&str, i32); 6] = [
            ("21", -973_932_308),
            ("foobar", -790_332_482),
            ("a-little-bit-long-string", -985_981_536),
            ("a-little-bit-longer-string", -1_486_304_829),
            (
                "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            ("abc", 479_470_107),
        ];
        for (s, want) in cases {
            assert_eq!(murmur2(s.as_bytes()), want, "{s}");
        }
    }

    #[test]
    fn partition_is_stable_and_in_range() {
        for n in 1..16 {
            for k in 0..100 {
                let key = format!("key-{k}");
                let p = partition_for_key(key.as_bytes(), n);
                assert!((0..n as i32).contains(&p));
                assert_eq!(p, partition_for_key(key.as_bytes(), n));
            }
        }
    }
}
