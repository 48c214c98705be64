//! The backend conformance suite on a real Apache Pulsar standalone with transactions on
//! (`transactions=true`, PIP-31, issue #27): its transaction cases run (commit makes records
//! visible, abort hides them, positions acknowledged in the transaction). A transactional id
//! does not fence an older producer on Pulsar (no producer epochs), and a connected failover
//! member that stops polling keeps its partitions (no session timeout): those two cases are
//! skipped with the reason; the partition check at commit is tested in
//! `adapters/pulsar/tests/transactions.rs`. Runs when
//! `ONCEFLOW_PULSAR_URL` is set (`tests/brokers/up.sh pulsar`).

mod pulsar_harness;

onceflow_conformance::backend_suite!(pulsar_harness::pulsar("transactions=true")
    .await
    .without_transactional_id_fencing()
    .without_session_timeout_removal());
