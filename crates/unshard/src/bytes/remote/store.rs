//! From a URL to an object store client and a key; the runtime that drives them; the
//! cache of directory listings; errors that name the object.
//!
//! Clients are built once per bucket (per `scheme://authority`) from the standard
//! environment (`object_store`'s `from_env`: `AWS_*`, `GOOGLE_*`, `AZURE_*`), so a
//! run of many files signs and connects once. Requests run on one small tokio runtime
//! of our own; callers are plain threads that block on a request's result.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::http::HttpBuilder;
use object_store::multipart::MultipartStore;
use object_store::path::Path as Key;
use object_store::{ClientConfigKey, ObjectStore, ObjectStoreExt, ObjectStoreScheme, RetryConfig};

use crate::error::{Error, Result};
use crate::text;

/// An object (or a prefix) in a store.
#[derive(Clone)]
pub struct Location {
    /// The client of its bucket.
    pub store: Arc<dyn ObjectStore>,
    /// The same client's multipart uploads, where the store has them.
    pub multipart: Option<Arc<dyn MultipartStore>>,
    /// Its key inside the bucket (no trailing `/`).
    pub key: Key,
    /// The URL messages name it by.
    pub url: PathBuf,
}

impl Location {
    /// The location `name` below this one.
    pub fn child(&self, name: &str) -> Location {
        Location {
            store: self.store.clone(),
            multipart: self.multipart.clone(),
            key: self.key.clone().join(name),
            url: self.url.join(name),
        }
    }
}

/// How long a request keeps being retried after connection errors and 5xx
/// answers, by default: long enough to outlast a server restart or a network
/// outage of tens of seconds on a long upload.
pub const RETRY_SECONDS: u64 = 120;

/// [`RETRY_SECONDS`], or `UNSHARD_RETRY_SECONDS` when set (0 to 3600; 0 retries
/// nothing).
pub fn retry_seconds() -> u64 {
    std::env::var("UNSHARD_RETRY_SECONDS")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(RETRY_SECONDS, |n| n.min(3600))
}

/// Requests (reads, each part of an upload, deletes) retried on connection errors
/// and 5xx answers for [`retry_seconds`], waiting 0.1 s, 0.2 s, ... up to 5 s between
/// tries, so a server back after an outage is used again within 5 s.
fn retry() -> RetryConfig {
    let secs = retry_seconds();
    RetryConfig {
        max_retries: if secs == 0 { 0 } else { 1000 },
        retry_timeout: Duration::from_secs(secs),
        backoff: object_store::BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            base: 2.0,
        },
    }
}

/// Runs `op` again after a failure of the connection itself that the client gave
/// up on: it retries a request cut after it was sent only when it knows the request
/// is idempotent, and a connection dropped by a restarting server can surface as a
/// kind it does not retry at all. Every caller's request is safe to repeat (a part
/// or an object of our own with the same bytes, a delete, an abort), so it is tried
/// again, waiting as [`retry`] does, until [`retry_seconds`] have passed since the
/// first try. Answers from the server (a status) are returned as they are: the
/// client has already retried those that deserve it.
pub async fn again<T, F, Fut>(op: F) -> object_store::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = object_store::Result<T>>,
{
    again_within(Duration::from_secs(retry_seconds()), op).await
}

/// [`again`] with tries made until `limit` has passed.
pub(crate) async fn again_within<T, F, Fut>(limit: Duration, mut op: F) -> object_store::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = object_store::Result<T>>,
{
    let start = std::time::Instant::now();
    let mut wait = Duration::from_millis(100);
    loop {
        match op().await {
            Err(e) if cut_connection(&e) && start.elapsed() + wait < limit => {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(5));
            }
            done => return done,
        }
    }
}

/// Whether `e` is a transport failure (no answer from the server) rather than an
/// answer.
fn cut_connection(e: &object_store::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if c.downcast_ref::<object_store::client::HttpError>()
            .is_some()
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Timeouts of one request. The crate's default, 30 s for a whole request, fails
/// GETs that are merely queued: 32 GETs of 16 MiB in flight take 43 s over a
/// 100 Mbit link, and a server that answers one request at a time (moto) keeps the
/// last in line waiting as long. So a request may take 10 minutes as long as bytes
/// keep coming: a read that waits 2 minutes for the next byte (a stalled
/// connection) fails and is retried, as is a connection not made in 5 s.
const TIMEOUTS: [(ClientConfigKey, &str); 3] = [
    (ClientConfigKey::Timeout, "10m"),
    (ClientConfigKey::ReadTimeout, "2m"),
    (ClientConfigKey::ConnectTimeout, "5s"),
];

/// A bucket's client, as the two traits the crate splits it into.
#[derive(Clone)]
struct Client {
    store: Arc<dyn ObjectStore>,
    /// Multipart uploads with explicit part numbers (S3, GCS, Azure; not HTTP).
    multipart: Option<Arc<dyn MultipartStore>>,
}

fn both<S: ObjectStore + MultipartStore>(s: S) -> Client {
    let s = Arc::new(s);
    Client {
        store: s.clone(),
        multipart: Some(s),
    }
}

/// Clients built so far, by `scheme://authority`.
static STORES: OnceLock<Mutex<HashMap<String, Client>>> = OnceLock::new();

/// Makes `base` (`scheme://bucket`) resolve to `store` (tests: an in-memory store).
#[cfg(test)]
pub(crate) fn register<S: ObjectStore + MultipartStore>(base: &str, store: Arc<S>) {
    let client = Client {
        store: store.clone(),
        multipart: Some(store),
    };
    let stores = STORES.get_or_init(Default::default);
    let mut stores = stores.lock().unwrap_or_else(|e| e.into_inner());
    stores.insert(base.to_string(), client);
}

/// Which kind of store `url` names (S3, GCS, Azure, HTTP...), read as [`locate`]
/// reads it; `None` for what is no object store URL.
pub fn scheme_of(url: &Path) -> Option<ObjectStoreScheme> {
    let url = url::Url::parse(url.to_str()?.trim_end_matches('/')).ok()?;
    ObjectStoreScheme::parse(&url)
        .ok()
        .map(|(scheme, _)| scheme)
}

/// The client and key of a URL; clients are cached per bucket.
pub fn locate(p: &Path) -> Result<Location> {
    let text = p
        .to_str()
        .ok_or_else(|| bad_url(p, "it is not valid UTF-8"))?;
    let trimmed = text.trim_end_matches('/');
    let url = url::Url::parse(trimmed).map_err(|e| bad_url(p, &e.to_string()))?;
    let (scheme, key) = ObjectStoreScheme::parse(&url).map_err(|e| bad_url(p, &e.to_string()))?;
    let base = &url[..url::Position::BeforePath];
    // Clients are known by the URL without its user info, which the client built
    // from the first URL keeps for its requests; every URL shown is without it.
    let shown_base = text::without_secrets(base);
    let stores = STORES.get_or_init(Default::default);
    let mut stores = stores.lock().unwrap_or_else(|e| e.into_inner());
    let client = match stores.get(&shown_base) {
        Some(c) => c.clone(),
        None => {
            install_crypto();
            let built: object_store::Result<Client> = match scheme {
                ObjectStoreScheme::AmazonS3 => TIMEOUTS
                    .iter()
                    .fold(s3_from_env()?, |b, &(k, v)| {
                        b.with_config(object_store::aws::AmazonS3ConfigKey::Client(k), v)
                    })
                    .with_url(trimmed)
                    .with_retry(retry())
                    .build()
                    .map(both),
                ObjectStoreScheme::GoogleCloudStorage => TIMEOUTS
                    .iter()
                    .fold(GoogleCloudStorageBuilder::from_env(), |b, &(k, v)| {
                        b.with_config(object_store::gcp::GoogleConfigKey::Client(k), v)
                    })
                    .with_url(trimmed)
                    .with_retry(retry())
                    .build()
                    .map(both),
                ObjectStoreScheme::MicrosoftAzure => TIMEOUTS
                    .iter()
                    .fold(MicrosoftAzureBuilder::from_env(), |b, &(k, v)| {
                        b.with_config(object_store::azure::AzureConfigKey::Client(k), v)
                    })
                    .with_url(trimmed)
                    .with_retry(retry())
                    .build()
                    .map(both),
                // A URL that says http:// asks for plain HTTP: allowed, as curl does.
                ObjectStoreScheme::Http => TIMEOUTS
                    .iter()
                    .fold(HttpBuilder::new(), |b, &(k, v)| b.with_config(k, v))
                    .with_config(
                        ClientConfigKey::AllowHttp,
                        (url.scheme() == "http").to_string(),
                    )
                    .with_url(base)
                    .with_retry(retry())
                    .build()
                    .map(|s| Client {
                        store: Arc::new(s),
                        multipart: None,
                    }),
                _ => return Err(bad_url(p, "not an object store URL")),
            };
            let client = built.map_err(|e| Error::Unsupported {
                path: shown(p),
                what: format!(
                    "this object store configuration ({})",
                    text::scrub(&e.to_string())
                ),
                hint: Some(credentials_hint().into()),
            })?;
            stores.insert(shown_base, client.clone());
            client
        }
    };
    Ok(Location {
        store: client.store,
        multipart: client.multipart,
        key,
        url: PathBuf::from(text::without_secrets(trimmed)),
    })
}

/// `p` as it may be shown: a URL without its user info and query.
pub fn shown(p: &Path) -> PathBuf {
    match p.to_str().and_then(text::redact_url) {
        Some(clean) => PathBuf::from(clean),
        None => p.to_path_buf(),
    }
}

/// An S3 client builder from the `AWS_*` variables, completed by the AWS profile
/// (`AWS_PROFILE`, `~/.aws/credentials`, `~/.aws/config`; see [`super::profile`]).
fn s3_from_env() -> Result<AmazonS3Builder> {
    let env = |k: &str| std::env::var(k).ok();
    let mut b = AmazonS3Builder::from_env();
    if let Some(p) = super::profile::load(&env)? {
        for (key, value) in super::profile::settings(&p, &env) {
            if let Ok(key) = key.parse::<object_store::aws::AmazonS3ConfigKey>() {
                b = b.with_config(key, value);
            }
        }
    }
    // The AWS CLI's S3-only endpoint variable, which object_store does not read.
    if let Some(e) = env("AWS_ENDPOINT_URL_S3").filter(|e| !e.is_empty()) {
        b = b.with_endpoint(e);
    }
    Ok(b)
}

/// What to set for credentials and endpoints.
pub fn credentials_hint() -> &'static str {
    "credentials come from the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_REGION, with AWS_ENDPOINT_URL and AWS_ALLOW_HTTP=true for an S3-compatible server), an AWS profile (AWS_PROFILE, ~/.aws/credentials, ~/.aws/config), GOOGLE_APPLICATION_CREDENTIALS, or AZURE_STORAGE_ACCOUNT_NAME/AZURE_STORAGE_ACCOUNT_KEY"
}

fn bad_url(p: &Path, why: &str) -> Error {
    Error::Unsupported {
        path: shown(p),
        what: format!("this URL ({why})"),
        hint: Some("write object storage locations as s3://bucket/key, gs://bucket/key, az://container/key or https://host/path".into()),
    }
}

/// TLS uses rustls with ring; the provider is installed once for the process.
pub(crate) fn install_crypto() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// The runtime every request runs on: two I/O threads are enough, requests spend
/// their time waiting for the network.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("unshard-io")
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("cannot start the I/O runtime: {e}"))
    })
}

/// Runs a request to completion from a plain (non-runtime) thread.
pub fn block_on<F: Future>(f: F) -> F::Output {
    runtime().block_on(f)
}

/// Starts a request in the background.
pub fn spawn<F>(f: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    runtime().spawn(f)
}

/// An object-store error as the library's I/O error on `url`: missing objects keep
/// the `NotFound` kind so callers can tell them apart.
pub fn io_error(op: &'static str, url: &Path, e: object_store::Error) -> Error {
    let kind = match e {
        object_store::Error::NotFound { .. } => io::ErrorKind::NotFound,
        object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. } => {
            io::ErrorKind::AlreadyExists
        }
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => io::ErrorKind::PermissionDenied,
        _ => io::ErrorKind::Other,
    };
    let mut msg = text::scrub(&e.to_string());
    let mut chain = String::new();
    let mut cause: Option<&dyn std::error::Error> = Some(&e);
    while let Some(c) = cause {
        chain.push_str(&c.to_string());
        chain.push('\n');
        cause = c.source();
    }
    if chain.contains("URL scheme is not allowed") {
        // An S3/GCS/Azure endpoint given as http:// (a local test server).
        let var = match scheme_of(url) {
            Some(ObjectStoreScheme::GoogleCloudStorage) => "GOOGLE_ALLOW_HTTP",
            Some(ObjectStoreScheme::MicrosoftAzure) => "AZURE_ALLOW_HTTP",
            _ => "AWS_ALLOW_HTTP",
        };
        msg.push_str(&format!(
            "; the endpoint is plain http://: set {var}=true to allow it (or use https://)"
        ));
    }
    Error::io(op, shown(url), io::Error::new(kind, msg))
}

/// What a listing found directly under a prefix: objects with their sizes, and
/// sub-prefixes ("directories").
#[derive(Debug, Default)]
pub struct Listing {
    pub files: BTreeMap<String, u64>,
    pub dirs: Vec<String>,
}

static LISTINGS: OnceLock<Mutex<HashMap<PathBuf, Arc<Listing>>>> = OnceLock::new();

/// The listing of `url` if one was already made.
pub fn cached_listing(url: &Path) -> Option<Arc<Listing>> {
    let url = Path::new(url.to_str()?.trim_end_matches('/'));
    LISTINGS
        .get()?
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(url)
        .cloned()
}

/// Lists the objects and sub-prefixes directly under `loc` (one request per 1000
/// entries), cached for the run: format detection asks about the same directory
/// several times.
pub fn list(loc: &Location) -> Result<Arc<Listing>> {
    let cache = LISTINGS.get_or_init(Default::default);
    if let Some(l) = cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&loc.url)
    {
        return Ok(l.clone());
    }
    let prefix = (!loc.key.as_ref().is_empty()).then_some(&loc.key);
    let result = block_on(again(|| loc.store.list_with_delimiter(prefix)))
        .map_err(|e| io_error("list", &loc.url, e))?;
    let mut listing = Listing::default();
    for o in result.objects {
        if let Some(name) = o.location.filename() {
            listing.files.insert(name.to_string(), o.size);
        }
    }
    for d in result.common_prefixes {
        if let Some(name) = d.filename() {
            listing.dirs.push(name.to_string());
        }
    }
    listing.dirs.sort();
    let listing = Arc::new(listing);
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(loc.url.clone(), listing.clone());
    Ok(listing)
}

/// Lists every object below `loc`, recursively and uncached (for outputs, which this
/// run changes): `(key relative to loc, size)`.
pub fn list_all(loc: &Location) -> Result<Vec<(String, u64)>> {
    use futures_util::StreamExt as _;
    let prefix = (!loc.key.as_ref().is_empty()).then_some(&loc.key);
    let store = loc.store.clone();
    let prefix = prefix.cloned();
    let base = loc.key.as_ref().to_string();
    let metas = block_on(async move {
        let mut out = Vec::new();
        let mut s = store.list(prefix.as_ref());
        while let Some(m) = s.next().await {
            out.push(m?);
        }
        Ok::<_, object_store::Error>(out)
    })
    .map_err(|e| io_error("list", &loc.url, e))?;
    Ok(metas
        .into_iter()
        .map(|m| {
            let k = m.location.as_ref();
            let rel = k
                .strip_prefix(&base)
                .unwrap_or(k)
                .trim_start_matches('/')
                .to_string();
            (rel, m.size)
        })
        .collect())
}

/// The size of one object, or `None` if there is none at that key.
pub fn head(loc: &Location) -> Result<Option<u64>> {
    match block_on(again(|| loc.store.head(&loc.key))) {
        Ok(m) => Ok(Some(m.size)),
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(io_error("read the size of", &loc.url, e)),
    }
}

/// A whole object (a small file: config, index, `.metadata`), or `None` if missing.
pub fn get_whole(loc: &Location) -> Result<Option<Vec<u8>>> {
    let got = block_on(again(|| async {
        let r = loc.store.get(&loc.key).await?;
        r.bytes().await
    }));
    match got {
        Ok(b) => Ok(Some(b.to_vec())),
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(io_error("read", &loc.url, e)),
    }
}
