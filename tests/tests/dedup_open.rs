//! `onceflow_core::dedup::open` / `open_with`: store URLs, and clear errors for the ones it
//! cannot open.

use std::time::Duration;

use onceflow_core::dedup::{open, open_with, ClaimOutcome, ClaimRequest, DedupStoreExt};
use onceflow_core::ErrorKind;

const WINDOW: Duration = Duration::from_secs(60);

async fn err(url: &str) -> onceflow_core::Error {
    match open(url, WINDOW).await {
        Ok(store) => panic!("'{url}' opened a {} store", store.name()),
        Err(e) => e,
    }
}

#[tokio::test]
async fn memory_urls() {
    for url in [
        "memory://",
        "memory:///",
        "MEMORY://",
        "memory://?capacity=5",
    ] {
        let store = open(url, WINDOW).await.unwrap();
        assert_eq!(store.name(), "memory", "{url}");
        assert_eq!(store.window(), WINDOW);
    }
    for (url, named) in [
        ("memory://?capacity=0", "'0'"),
        ("memory://?capacity=-3", "'-3'"),
        ("memory://?capacity=ten", "'ten'"),
        ("memory://?size=5", "'size'"),
        ("memory://shared-name", "'shared-name'"),
    ] {
        let e = err(url).await;
        assert_eq!(e.kind(), ErrorKind::Config, "{url}: {e}");
        assert!(e.message().contains(named), "{url}: {e}");
    }
}

#[tokio::test]
async fn embedded_urls_and_plain_paths_open_the_same_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a b.db");
    let url = format!("embedded://{}", dir.path().join("a%20b.db").display());
    let store = open(&url, WINDOW).await.unwrap();
    assert_eq!(store.name(), "embedded");
    let ClaimOutcome::Claimed { token } = store
        .claim_one(ClaimRequest {
            key: "k".into(),
            owner: "w".into(),
            lease: WINDOW,
            fingerprint: None,
        })
        .await
        .unwrap()
    else {
        panic!("not claimed")
    };
    assert!(store.complete_one("k", token, None).await.unwrap());
    drop(store);
    assert!(path.exists(), "percent-escapes not decoded");
    let store = open(path.to_str().unwrap(), WINDOW).await.unwrap();
    assert!(matches!(
        store.get_one("k").await.unwrap(),
        Some(onceflow_core::dedup::KeyState::Completed { .. })
    ));
}

#[tokio::test]
async fn embedded_url_without_absolute_path_is_a_config_error() {
    for url in ["embedded://relative/x.db", "embedded:///tmp/x.db?sync=full"] {
        let e = err(url).await;
        assert_eq!(e.kind(), ErrorKind::Config, "{url}: {e}");
        assert!(e.message().contains(url), "{url}: {e}");
    }
}

/// A path in a directory that does not exist is bad input (`Config`, like a directory given as
/// the path), as a plain path and as a URL; a file that is there but is no database cannot be
/// opened (`DedupStore`). Both name the path.
#[tokio::test]
async fn unusable_path_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("no-such-dir").join("d.db");
    let path = path.to_str().unwrap();
    for location in [path.to_string(), format!("embedded://{path}")] {
        let e = err(&location).await;
        assert_eq!(e.kind(), ErrorKind::Config, "{location}: {e}");
        assert!(e.message().contains(&location), "{e}");
        assert!(e.message().contains("does not exist"), "{e}");
    }
    assert!(!dir.path().join("no-such-dir").exists(), "directory made");
    let not_a_db = dir.path().join("notes.txt");
    std::fs::write(
        &not_a_db,
        "not an SQLite database, but long enough to have a header.",
    )
    .unwrap();
    let e = err(not_a_db.to_str().unwrap()).await;
    assert_eq!(e.kind(), ErrorKind::DedupStore, "{e}");
    assert!(e.message().contains(not_a_db.to_str().unwrap()), "{e}");
}

/// A directory is bad input however the embedded store is named: plain path or URL.
#[tokio::test]
async fn a_directory_is_bad_input_as_a_path_and_as_a_url() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_str().unwrap().to_string();
    for location in [path.clone(), format!("embedded://{path}")] {
        let e = err(&location).await;
        assert_eq!(e.kind(), ErrorKind::Config, "{location}: {e}");
        assert!(
            e.message().contains("is a directory") && e.message().contains(&location),
            "{location}: {e}"
        );
    }
    // A device is no database file either (SQLite would put a journal beside /dev/null).
    for location in ["/dev/null", "embedded:///dev/null"] {
        let e = err(location).await;
        assert_eq!(e.kind(), ErrorKind::Config, "{location}: {e}");
        assert!(
            e.message().contains("not a regular file"),
            "{location}: {e}"
        );
    }
    assert!(!std::path::Path::new("/dev/null-journal").exists());
}

/// Core names no store of another crate: without registry entries a shared store's URL is an
/// unknown scheme, whose error points to the facade's opener.
#[tokio::test]
async fn shared_store_schemes_are_unknown_to_core_alone() {
    for url in [
        "redis://127.0.0.1:6379",
        "rediss://cache.example:6380",
        "postgres://u@localhost/db",
        "postgresql://u@localhost/db",
    ] {
        let e = err(url).await;
        assert_eq!(e.kind(), ErrorKind::Config, "{url}: {e}");
        assert!(e.message().contains("onceflow::dedup_store"), "{url}: {e}");
        assert!(!e.message().contains("onceflow-redis"), "{url}: {e}");
    }
}

/// With the build's registry entries (`onceflow::STORES`), the catalogue in the errors is
/// theirs: an unknown scheme lists every store's scheme.
#[tokio::test]
async fn unknown_scheme_lists_the_supported_ones() {
    let e = match open_with("bogus://x", WINDOW, onceflow::STORES).await {
        Ok(store) => panic!("'bogus://x' opened a {} store", store.name()),
        Err(e) => e,
    };
    assert_eq!(e.kind(), ErrorKind::Config);
    for needle in [
        "'bogus://'",
        "bogus://x",
        "memory://",
        "embedded://",
        "redis://",
        "postgres://",
    ] {
        assert!(e.message().contains(needle), "missing {needle}: {e}");
    }
    assert_eq!(err("").await.kind(), ErrorKind::Config);
    for bare in ["memory", "memory:", "embedded", "redis"] {
        let e = match open_with(bare, WINDOW, onceflow::STORES).await {
            Ok(store) => panic!("'{bare}' opened a {} store", store.name()),
            Err(e) => e,
        };
        assert_eq!(e.kind(), ErrorKind::Config, "{bare}: {e}");
        assert!(e.message().contains("://"), "{bare}: {e}");
        assert!(
            !std::path::Path::new(bare).exists(),
            "{bare}: a file was created"
        );
    }
}

#[tokio::test]
async fn zero_window_is_a_config_error() {
    let e = match open("memory://", Duration::ZERO).await {
        Ok(_) => panic!("zero window accepted"),
        Err(e) => e,
    };
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.message().contains("window"), "{e}");
}
