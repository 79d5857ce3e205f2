//! A test store: the in-memory store (or a real server's) behind a connection that
//! cuts requests, for the retry tests of the readers, the bucket sink and the parts'
//! meeting.
#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::sync::Arc;

use futures_util::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as Key;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartId, MultipartUpload, ObjectMeta,
    ObjectStore, ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

/// A store with multipart uploads: the in-memory one, or a server's.
pub(crate) trait Backing: ObjectStore + MultipartStore {}

impl<S: ObjectStore + MultipartStore> Backing for S {}

/// Requests to refuse, by kind: how many to let through first, then how many to
/// refuse.
type Refusals = std::sync::Mutex<Vec<(&'static str, usize, usize)>>;

/// Whether this request of `kind` is to be refused, by `refused` (see [`Cut::refuse`]).
fn refusing(refused: &Refusals, kind: &str) -> bool {
    let mut refused = refused.lock().unwrap();
    let Some((_, skip, n)) = refused.iter_mut().find(|(k, _, n)| *k == kind && *n > 0) else {
        return false;
    };
    if *skip > 0 {
        *skip -= 1;
        return false;
    }
    *n -= 1;
    true
}

/// The error a refused request fails with: a server's answer, not retried.
fn refusal(kind: &str) -> object_store::Error {
    object_store::Error::PermissionDenied {
        path: kind.into(),
        source: "refused by the test store".into(),
    }
}

/// The in-memory store behind a connection that is cut, as a restarting server's
/// or a broken network path's is: the first requests of some kinds fail with a
/// transport error that the client does not retry, either before the server did
/// the work or after (the answer lost on the way back).
#[derive(Debug)]
pub(crate) struct Cut {
    pub(crate) inner: Arc<dyn Backing>,
    /// Requests still to cut, by kind, and whether after the work.
    left: std::sync::Mutex<Vec<(&'static str, usize, bool)>>,
    /// Requests cut so far, by kind.
    pub(crate) cut: std::sync::Mutex<Vec<&'static str>>,
    /// Requests to answer with an error, by kind: how many to let through first,
    /// then how many to refuse.
    refused: Arc<Refusals>,
    /// Objects written and deleted, in order (`put KEY`, `delete KEY`).
    pub(crate) log: Arc<std::sync::Mutex<Vec<String>>>,
    /// Multipart uploads created, and those completed or aborted.
    pub(crate) uploads: std::sync::Mutex<(Vec<MultipartId>, Vec<MultipartId>)>,
}

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Cut({})", self.inner)
    }
}

impl Cut {
    /// A store that cuts, per `(kind, count, after)`, the first `count` requests of
    /// `kind` (`put`, `get`, `head`, `put_part`, `complete`, `abort`), after the work if `after`.
    pub(crate) fn new(plan: &[(&'static str, usize, bool)]) -> Cut {
        Cut::over(Arc::new(InMemory::new()), plan)
    }

    /// The same in front of `inner`.
    pub(crate) fn over(inner: Arc<dyn Backing>, plan: &[(&'static str, usize, bool)]) -> Cut {
        Cut {
            inner,
            left: std::sync::Mutex::new(plan.to_vec()),
            cut: std::sync::Mutex::default(),
            refused: Arc::default(),
            log: Arc::default(),
            uploads: std::sync::Mutex::default(),
        }
    }

    /// Answers the requests of `kind` after the first `skip` with a server's
    /// refusal (permission denied, not retried), `n` times.
    pub(crate) fn refuse(&self, kind: &'static str, skip: usize, n: usize) {
        self.refused.lock().unwrap().push((kind, skip, n));
    }

    /// Whether this request of `kind` is to be refused.
    fn refusing(&self, kind: &'static str) -> bool {
        refusing(&self.refused, kind)
    }

    /// Cuts the next `n` requests of `kind` too (after the work if `after`).
    pub(crate) fn arm(&self, kind: &'static str, n: usize, after: bool) {
        self.left.lock().unwrap().push((kind, n, after));
    }

    /// `Some(after)` when this request of `kind` is to be cut.
    fn take(&self, kind: &'static str) -> Option<bool> {
        let mut left = self.left.lock().unwrap();
        let (_, n, after) = left.iter_mut().find(|(k, n, _)| *k == kind && *n > 0)?;
        *n -= 1;
        self.cut.lock().unwrap().push(kind);
        Some(*after)
    }

    /// The error a cut request fails with: a transport error, no answer.
    pub(crate) fn error() -> object_store::Error {
        use object_store::client::{HttpError, HttpErrorKind};
        object_store::Error::Generic {
            store: "Cut",
            source: Box::new(HttpError::new(
                HttpErrorKind::Unknown,
                std::io::Error::other("connection closed before the answer"),
            )),
        }
    }

    /// Runs `work` unless this request is cut before it; fails it if cut after.
    async fn call<T>(
        &self,
        kind: &'static str,
        work: impl Future<Output = object_store::Result<T>>,
    ) -> object_store::Result<T> {
        if self.refusing(kind) {
            return Err(refusal(kind));
        }
        match self.take(kind) {
            Some(false) => Err(Cut::error()),
            Some(true) => {
                work.await?;
                Err(Cut::error())
            }
            None => work.await,
        }
    }
}

#[async_trait::async_trait]
impl ObjectStore for Cut {
    async fn put_opts(
        &self,
        k: &Key,
        p: PutPayload,
        o: PutOptions,
    ) -> object_store::Result<PutResult> {
        let done = self.call("put", self.inner.put_opts(k, p, o)).await;
        if done.is_ok() {
            self.log.lock().unwrap().push(format!("put {k}"));
        }
        done
    }
    async fn put_multipart_opts(
        &self,
        k: &Key,
        o: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(k, o).await
    }
    async fn get_opts(&self, k: &Key, o: GetOptions) -> object_store::Result<GetResult> {
        let kind = if o.head { "head" } else { "get" };
        self.call(kind, self.inner.get_opts(k, o)).await
    }
    fn delete_stream(
        &self,
        keys: BoxStream<'static, object_store::Result<Key>>,
    ) -> BoxStream<'static, object_store::Result<Key>> {
        use futures_util::StreamExt as _;
        let (refused, log) = (self.refused.clone(), self.log.clone());
        let keys = keys
            .map(move |k| match k {
                Ok(_) if refusing(&refused, "delete") => Err(refusal("delete")),
                k => k,
            })
            .boxed();
        self.inner
            .delete_stream(keys)
            .map(move |k| {
                if let Ok(k) = &k {
                    log.lock().unwrap().push(format!("delete {k}"));
                }
                k
            })
            .boxed()
    }
    fn list(&self, prefix: Option<&Key>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }
    async fn list_with_delimiter(&self, prefix: Option<&Key>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }
    async fn copy_opts(&self, from: &Key, to: &Key, o: CopyOptions) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, o).await
    }
}

#[async_trait::async_trait]
impl MultipartStore for Cut {
    async fn create_multipart(&self, k: &Key) -> object_store::Result<MultipartId> {
        let id = self.inner.create_multipart(k).await?;
        self.uploads.lock().unwrap().0.push(id.clone());
        Ok(id)
    }
    async fn put_part(
        &self,
        k: &Key,
        id: &MultipartId,
        n: usize,
        p: PutPayload,
    ) -> object_store::Result<PartId> {
        self.call("put_part", self.inner.put_part(k, id, n, p))
            .await
    }
    async fn complete_multipart(
        &self,
        k: &Key,
        id: &MultipartId,
        parts: Vec<PartId>,
    ) -> object_store::Result<PutResult> {
        let done = self
            .call("complete", self.inner.complete_multipart(k, id, parts))
            .await;
        // A completion cut after the work ended the upload too.
        if done.is_ok() || self.inner.head(k).await.is_ok() {
            self.uploads.lock().unwrap().1.push(id.clone());
        }
        done
    }
    async fn abort_multipart(&self, k: &Key, id: &MultipartId) -> object_store::Result<()> {
        self.call("abort", self.inner.abort_multipart(k, id))
            .await?;
        self.uploads.lock().unwrap().1.push(id.clone());
        Ok(())
    }
}

/// A new bucket on the test server (`UNSHARD_TEST_S3_ENDPOINT`, a moto_server
/// `.ci/run` starts), named `NAME-PID`. The tests that call this are `#[ignore]`d;
/// run with `--ignored`, a missing server is a failure.
pub(crate) fn server_bucket(name: &str) -> (String, Arc<object_store::aws::AmazonS3>) {
    use std::io::{Read, Write};
    let ep = match std::env::var("UNSHARD_TEST_S3_ENDPOINT") {
        Ok(e) if !e.is_empty() => e,
        _ => panic!(
            "no S3 test server: start moto_server and set UNSHARD_TEST_S3_ENDPOINT=http://127.0.0.1:PORT (docs/testing.md)"
        ),
    };
    let bucket = format!("{name}-{}", std::process::id());
    let hostport = ep.trim_start_matches("http://").trim_end_matches('/');
    let mut s = std::net::TcpStream::connect(hostport).unwrap();
    write!(
        s,
        "PUT /{bucket} HTTP/1.1\r\nHost: {hostport}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    crate::bytes::remote::store::install_crypto();
    let s3 = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(&ep)
        .with_allow_http(true)
        .with_bucket_name(&bucket)
        .with_region("us-east-1")
        .with_access_key_id("test")
        .with_secret_access_key("test")
        .build()
        .unwrap();
    (bucket, Arc::new(s3))
}
