//! `onceflow_kafka::open`'s checks that need no broker: settings librdkafka refuses are
//! `Config` errors naming the property whether or not a broker is up (before, an unreachable
//! address hid them behind a `Connect` error), secret values never shown, and a valid URL
//! without a broker is `Connect`. Port 9 (discard) has no listener here.

use onceflow_core::ErrorKind;

async fn refused(url: &str) -> onceflow_core::Error {
    match onceflow_kafka::open(url).await {
        Ok(_) => panic!("{url} was accepted"),
        Err(e) => e,
    }
}

#[tokio::test]
async fn an_unknown_property_is_a_config_error_naming_it_without_a_broker() {
    let e = refused("kafka://127.0.0.1:9?no.such.option=1").await;
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.message().contains("'no.such.option'"), "{e}");
    assert!(!e.message().contains("value not shown"), "{e}");
}

#[tokio::test]
async fn an_unsupported_sasl_mechanism_is_a_config_error_without_a_broker() {
    let e =
        refused("kafka://127.0.0.1:9?security.protocol=sasl_plaintext&sasl.mechanism=BOGUS").await;
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.message().contains("SASL mechanism: BOGUS"), "{e}");
    assert!(!e.message().contains("Client creation error"), "{e}");
}

#[tokio::test]
async fn a_mistyped_secret_property_never_shows_its_value() {
    let e = refused("kafka://127.0.0.1:9?sasl.pasword=hunter2-secret").await;
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.message().contains("'sasl.pasword'"), "{e}");
    assert!(!format!("{e} {e:?}").contains("hunter2"), "{e:?}");
}

#[tokio::test]
async fn valid_settings_without_a_broker_are_a_connect_error() {
    let e = refused("kafka://127.0.0.1:9?linger.ms=5").await;
    assert_eq!(e.kind(), ErrorKind::Connect, "{e}");
}
