//! Where a connection's AWS region and credentials come from: aws-config's own providers,
//! chosen and ordered by the URL (see the crate docs, "Credentials and region").

use aws_config::default_provider::credentials::DefaultCredentialsChain;
use aws_config::ecs::EcsCredentialsProvider;
use aws_config::environment::{
    EnvironmentVariableCredentialsProvider, EnvironmentVariableRegionProvider,
};
use aws_config::meta::credentials::CredentialsProviderChain;
use aws_config::meta::region::RegionProviderChain;
use aws_config::profile::{ProfileFileCredentialsProvider, ProfileFileRegionProvider};
use aws_config::provider_config::ProviderConfig;
use aws_config::sts::AssumeRoleProvider;
use aws_config::web_identity_token::WebIdentityTokenCredentialsProvider;
use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_credential_types::provider::error::CredentialsError;
use aws_credential_types::provider::{future, ProvideCredentials, SharedCredentialsProvider};
use aws_credential_types::Credentials;
use onceflow_core::{Error, ErrorKind, Result};

use crate::config::KinesisOptions;

/// Access key id of the fixed local test keys (a local server accepts any key, but needs a
/// signed request).
pub(crate) const LOCAL_TEST_KEY_ID: &str = "onceflow-local";

/// Region used with an endpoint override when none is configured anywhere.
const FALLBACK_REGION: &str = "us-east-1";

/// The SDK configuration of a connection (region, timeouts, credentials provider) and a
/// description of where its credentials come from, for errors and logs.
pub(crate) struct Resolved {
    pub(crate) sdk: SdkConfig,
    pub(crate) source: String,
}

/// Where the base credentials (before any assumed role) come from.
enum Base {
    /// `dummy_credentials=true`.
    Fixed,
    /// `profile=NAME`: that profile only.
    Profile(String),
    /// Loopback endpoint, `dummy_credentials` unset: environment, profile, web identity,
    /// container, then the fixed keys if none of them has credentials.
    LocalChain,
    /// The SDK's default chain: environment, profile, web identity, container, instance
    /// metadata.
    DefaultChain,
}

fn fixed_keys() -> Credentials {
    Credentials::new(
        LOCAL_TEST_KEY_ID,
        "onceflow-local",
        None,
        None,
        "onceflow-local-test-keys",
    )
}

fn profile_of_env() -> String {
    match std::env::var("AWS_PROFILE") {
        Ok(p) if !p.is_empty() => format!("profile '{p}' (AWS_PROFILE)"),
        _ => "profile 'default'".to_string(),
    }
}

/// The SDK configuration for `options`: region and credentials as the crate docs describe.
/// `Config` when no region is found for AWS's own endpoint.
pub(crate) async fn resolve(
    options: &KinesisOptions,
    timeouts: aws_config::timeout::TimeoutConfig,
) -> Result<Resolved> {
    let loopback = options.endpoint_is_loopback();
    let base = match (options.dummy_credentials, &options.profile) {
        (Some(true), _) => Base::Fixed,
        (_, Some(p)) => Base::Profile(p.clone()),
        (None, None) if loopback => Base::LocalChain,
        _ => Base::DefaultChain,
    };

    let mut loader = aws_config::defaults(BehaviorVersion::latest()).timeout_config(timeouts);
    if let Some(p) = &options.profile {
        loader = loader.profile_name(p);
    }
    if let Some(r) = &options.region {
        loader = loader.region(Region::new(r.clone()));
    } else if options.endpoint.is_some() {
        // With an endpoint override: AWS_REGION, the profile's region, else us-east-1; instance
        // metadata is not asked (the endpoint says where requests go).
        let mut profile_region = ProfileFileRegionProvider::builder();
        if let Some(p) = &options.profile {
            profile_region = profile_region.profile_name(p);
        }
        loader = loader.region(
            RegionProviderChain::first_try(EnvironmentVariableRegionProvider::new())
                .or_else(profile_region.build())
                .or_else(Region::from_static(FALLBACK_REGION)),
        );
    }
    if !matches!(base, Base::DefaultChain) {
        loader = loader.no_credentials();
    }
    let sdk = loader.load().await;
    let Some(region) = sdk.region().cloned() else {
        return Err(Error::config(
            "no AWS region for Kinesis: give region= in the URL, set AWS_REGION, or set \
             `region` in the profile (shared config file)",
        ));
    };
    let provider_config = ProviderConfig::default().with_region(Some(region.clone()));

    let (provider, mut source): (SharedCredentialsProvider, String) = match base {
        Base::Fixed => (
            SharedCredentialsProvider::new(fixed_keys()),
            "fixed local test keys (dummy_credentials=true)".to_string(),
        ),
        Base::Profile(p) => (
            SharedCredentialsProvider::new(
                ProfileFileCredentialsProvider::builder()
                    .configure(&provider_config)
                    .profile_name(&p)
                    .build(),
            ),
            format!(
                "profile '{p}' (URL profile=) of the shared config and credentials files \
                 ({})",
                profile_files()
            ),
        ),
        Base::LocalChain => {
            let chain = CredentialsProviderChain::first_try(
                "Environment",
                EnvironmentVariableCredentialsProvider::new(),
            )
            .or_else(
                "Profile",
                ProfileFileCredentialsProvider::builder()
                    .configure(&provider_config)
                    .build(),
            )
            .or_else(
                "WebIdentityToken",
                WebIdentityTokenCredentialsProvider::builder()
                    .configure(&provider_config)
                    .build(),
            )
            .or_else(
                "EcsContainer",
                EcsCredentialsProvider::builder()
                    .configure(&provider_config)
                    .build(),
            );
            (
                SharedCredentialsProvider::new(LocalFallback { chain }),
                format!(
                    "the AWS credential chain (environment, {}, web identity, container), \
                     else fixed local test keys for this loopback endpoint",
                    profile_of_env()
                ),
            )
        }
        Base::DefaultChain => match sdk.credentials_provider() {
            Some(p) => (
                p,
                format!(
                    "the AWS default credential chain (environment, {}, web identity, \
                     container, instance metadata)",
                    profile_of_env()
                ),
            ),
            None => (
                SharedCredentialsProvider::new(
                    DefaultCredentialsChain::builder()
                        .configure(provider_config)
                        .build()
                        .await,
                ),
                format!(
                    "the AWS default credential chain (environment, {}, web identity, \
                     container, instance metadata)",
                    profile_of_env()
                ),
            ),
        },
    };

    let provider = match &options.role_arn {
        None => provider,
        Some(arn) => {
            let mut b = AssumeRoleProvider::builder(arn.clone())
                .configure(&sdk)
                .region(region.clone());
            if let Some(n) = &options.role_session_name {
                b = b.session_name(n.clone());
            }
            if let Some(x) = &options.external_id {
                b = b.external_id(x.clone());
            }
            if let Some(d) = options.role_duration {
                b = b.session_length(d);
            }
            source = format!("role '{arn}' assumed through STS AssumeRole, with {source}");
            SharedCredentialsProvider::new(b.build_from_provider(provider).await)
        }
    };
    let provider = SharedCredentialsProvider::new(Named {
        inner: provider,
        source: source.clone(),
    });
    let sdk = sdk.into_builder().credentials_provider(provider).build();
    Ok(Resolved { sdk, source })
}

/// The shared files the SDK reads, as configured (`AWS_CONFIG_FILE`,
/// `AWS_SHARED_CREDENTIALS_FILE`, else `~/.aws/config` and `~/.aws/credentials`).
fn profile_files() -> String {
    let var = |k: &str, d: &str| match std::env::var(k) {
        Ok(v) if !v.is_empty() => v,
        _ => d.to_string(),
    };
    format!(
        "{}, {}",
        var("AWS_CONFIG_FILE", "~/.aws/config"),
        var("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")
    )
}

/// Environment variables that configure a credential source: with any of them set, finding
/// no credentials is an error, never a reason to use the fixed local keys.
const CREDENTIAL_VARS: &[&str] = &[
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
];

/// The local chain, with the fixed test keys when it finds no credentials and nothing in the
/// environment asks for any (a half-set `AWS_ACCESS_KEY_ID`, or an `AWS_PROFILE` that is
/// missing or has no credentials, is an error instead).
#[derive(Debug)]
struct LocalFallback {
    chain: CredentialsProviderChain,
}

impl ProvideCredentials for LocalFallback {
    fn provide_credentials<'a>(&'a self) -> future::ProvideCredentials<'a>
    where
        Self: 'a,
    {
        future::ProvideCredentials::new(async move {
            match self.chain.provide_credentials().await {
                Err(CredentialsError::CredentialsNotLoaded(_)) => {
                    let set: Vec<&str> = CREDENTIAL_VARS
                        .iter()
                        .copied()
                        .filter(|k| std::env::var_os(k).is_some_and(|v| !v.is_empty()))
                        .collect();
                    if set.is_empty() {
                        tracing::debug!(
                            "no AWS credentials in the environment, profile, web identity \
                             or container: signing with fixed local test keys for the \
                             loopback endpoint"
                        );
                        return Ok(fixed_keys());
                    }
                    let profile = match std::env::var("AWS_PROFILE") {
                        Ok(p) if !p.is_empty() => format!(
                            "; profile '{p}' (AWS_PROFILE) is not defined or has no \
                             credentials in {}",
                            profile_files()
                        ),
                        _ => String::new(),
                    };
                    Err(CredentialsError::not_loaded(format!(
                        "{} set, but no provider found complete credentials{profile}",
                        set.join(", ")
                    )))
                }
                other => other,
            }
        })
    }
}

/// A provider whose errors say where the credentials were looked for (the source
/// description), keeping the error's variant.
#[derive(Debug)]
struct Named {
    inner: SharedCredentialsProvider,
    source: String,
}

impl ProvideCredentials for Named {
    fn provide_credentials<'a>(&'a self) -> future::ProvideCredentials<'a>
    where
        Self: 'a,
    {
        future::ProvideCredentials::new(async move {
            self.inner.provide_credentials().await.map_err(|e| {
                let why = detail(&e);
                let source = &self.source;
                match e {
                    CredentialsError::CredentialsNotLoaded(_) => CredentialsError::not_loaded(
                        format!("no AWS credentials from {source}: {why}"),
                    ),
                    CredentialsError::ProviderTimedOut(_) => CredentialsError::provider_error(
                        format!("AWS credentials from {source}: timed out: {why}"),
                    ),
                    CredentialsError::InvalidConfiguration(_) => {
                        CredentialsError::invalid_configuration(format!(
                            "AWS credentials from {source}: invalid configuration: {why}"
                        ))
                    }
                    _ => CredentialsError::provider_error(format!(
                        "AWS credentials from {source}: {why}"
                    )),
                }
            })
        })
    }
}

/// What a credentials error says beyond its variant's generic text ("the credential provider
/// was not enabled", "an error occurred while loading credentials"): the texts of its
/// sources, skipping those of nested credentials errors that have a source of their own.
fn detail(e: &CredentialsError) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut cur = std::error::Error::source(e);
    while let Some(c) = cur {
        let generic = c.downcast_ref::<CredentialsError>().is_some() && c.source().is_some();
        let s = c.to_string();
        if !generic && parts.last().is_none_or(|l| !l.contains(&s)) {
            parts.push(s);
        }
        cur = c.source();
    }
    if parts.is_empty() {
        e.to_string()
    } else {
        parts.join(": ")
    }
}

/// The credentials error somewhere in `e`'s source chain, if any.
pub(crate) fn find_credentials_error<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> Option<&'a CredentialsError> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cur {
        if let Some(ce) = c.downcast_ref::<CredentialsError>() {
            return Some(ce);
        }
        cur = c.source();
    }
    None
}

/// An `Auth` error for a call that could not be signed because credentials failed to load.
pub(crate) fn auth_error(what: &str, e: &CredentialsError) -> Error {
    Error::new(ErrorKind::Auth, format!("Kinesis {what}: {}", detail(e)))
}
