//! Real object-storage servers for the object-storage tests: `.ci/run` starts
//! `moto_server` (S3) and Azurite (Azure Blob Storage) on loopback ports and exports
//! `UNSHARD_TEST_S3_ENDPOINT` and `UNSHARD_TEST_AZURE_ENDPOINT`. Fixtures are uploaded
//! with the `object_store` crate's own clients (not unshard's code), each test in a
//! bucket (or container) of its own.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::path::Path as Key;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

/// The endpoint of the test server. The tests that call this are `#[ignore]`d (so
/// that `cargo test` counts them as not run); run with `--ignored`, a missing server
/// is a failure.
pub fn endpoint(test: &str) -> String {
    match std::env::var("UNSHARD_TEST_S3_ENDPOINT") {
        Ok(e) if !e.is_empty() => e,
        _ => panic!(
            "{test}: no S3 test server: start moto_server and set UNSHARD_TEST_S3_ENDPOINT=http://127.0.0.1:PORT (docs/testing.md; .ci/run does this)"
        ),
    }
}

/// The Azurite endpoint (`http://127.0.0.1:PORT`, without the account). The tests
/// that call this are `#[ignore]`d like the S3 ones.
pub fn azure_endpoint(test: &str) -> String {
    match std::env::var("UNSHARD_TEST_AZURE_ENDPOINT") {
        Ok(e) if !e.is_empty() => e,
        _ => panic!(
            "{test}: no Azure test server: start azurite-blob and set UNSHARD_TEST_AZURE_ENDPOINT=http://127.0.0.1:PORT (docs/testing.md; .ci/run does this)"
        ),
    }
}

/// Azurite's well-known development account and its key (public, documented by
/// Microsoft for the emulator).
const AZURITE_ACCOUNT: &str = "devstoreaccount1";
pub const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// Which kind of server a bucket is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Server {
    S3,
    Azure,
}

/// A bucket on the test server, created empty for one test.
pub struct Bucket {
    pub endpoint: String,
    pub name: String,
    pub server: Server,
    pub store: Arc<dyn ObjectStore>,
    rt: tokio::runtime::Runtime,
}

impl Bucket {
    pub fn create(endpoint: &str, name: &str) -> Bucket {
        // CreateBucket is not part of object_store's API: one plain HTTP request.
        let hostport = endpoint.trim_start_matches("http://").trim_end_matches('/');
        let mut s = std::net::TcpStream::connect(hostport).unwrap();
        write!(
            s,
            "PUT /{name} HTTP/1.1\r\nHost: {hostport}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        assert!(
            answer.starts_with("HTTP/1.1 200"),
            "CreateBucket {name}: {answer}"
        );
        let _ = rustls::crypto::ring::default_provider().install_default();
        let store = AmazonS3Builder::new()
            .with_endpoint(endpoint)
            .with_allow_http(true)
            .with_bucket_name(name)
            .with_region("us-east-1")
            .with_access_key_id("test")
            .with_secret_access_key("test")
            .build()
            .unwrap();
        Bucket::with(endpoint, name, Server::S3, Arc::new(store))
    }

    /// A bucket on `server`, at the endpoint the environment gives for it.
    pub fn on(server: Server, test: &str) -> Bucket {
        match server {
            Server::S3 => Bucket::create(&endpoint(test), &bucket_name(test)),
            Server::Azure => Bucket::create_azure(&azure_endpoint(test), &bucket_name(test)),
        }
    }

    /// A container on Azurite, created empty for one test. Creating a container is
    /// not part of object_store's API: one request signed with the account key
    /// (Shared Key authorization, as Azure documents it).
    pub fn create_azure(endpoint: &str, name: &str) -> Bucket {
        let hostport = endpoint.trim_start_matches("http://").trim_end_matches('/');
        let date = http_date(std::time::SystemTime::now());
        let version = "2021-08-06";
        let to_sign = format!(
            "PUT\n\n\n\n\n\n\n\n\n\n\n\nx-ms-date:{date}\nx-ms-version:{version}\n/{AZURITE_ACCOUNT}/{AZURITE_ACCOUNT}/{name}\nrestype:container"
        );
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD;
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &b64.decode(AZURITE_KEY).unwrap());
        let signature = b64.encode(ring::hmac::sign(&key, to_sign.as_bytes()).as_ref());
        let mut s = std::net::TcpStream::connect(hostport)
            .unwrap_or_else(|e| panic!("cannot reach Azurite at {hostport}: {e}"));
        write!(
            s,
            "PUT /{AZURITE_ACCOUNT}/{name}?restype=container HTTP/1.1\r\nHost: {hostport}\r\nx-ms-date: {date}\r\nx-ms-version: {version}\r\nAuthorization: SharedKey {AZURITE_ACCOUNT}:{signature}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        assert!(
            answer.starts_with("HTTP/1.1 201"),
            "Create Container {name}: {answer}"
        );
        let _ = rustls::crypto::ring::default_provider().install_default();
        let store = MicrosoftAzureBuilder::new()
            .with_endpoint(format!(
                "{}/{AZURITE_ACCOUNT}",
                endpoint.trim_end_matches('/')
            ))
            .with_allow_http(true)
            .with_account(AZURITE_ACCOUNT)
            .with_access_key(AZURITE_KEY)
            .with_container_name(name)
            .build()
            .unwrap();
        Bucket::with(endpoint, name, Server::Azure, Arc::new(store))
    }

    fn with(endpoint: &str, name: &str, server: Server, store: Arc<dyn ObjectStore>) -> Bucket {
        Bucket {
            endpoint: endpoint.to_string(),
            name: name.to_string(),
            server,
            store,
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
        }
    }

    /// `s3://bucket/key` or `az://container/key`.
    pub fn url(&self, key: &str) -> String {
        let scheme = match self.server {
            Server::S3 => "s3",
            Server::Azure => "az",
        };
        format!("{scheme}://{}/{}", self.name, key)
    }

    pub fn put(&self, key: &str, data: Vec<u8>) {
        self.rt
            .block_on(self.store.put(&Key::from(key), PutPayload::from(data)))
            .unwrap();
    }

    /// Uploads a file, or a directory tree (hidden files such as `.metadata` too).
    pub fn upload(&self, local: &Path, key: &str) {
        if local.is_dir() {
            for e in std::fs::read_dir(local).unwrap() {
                let e = e.unwrap();
                let name = e.file_name().to_string_lossy().into_owned();
                self.upload(&e.path(), &format!("{key}/{name}"));
            }
        } else {
            self.put(key, std::fs::read(local).unwrap());
        }
    }

    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        let r = self.rt.block_on(async {
            let g = self.store.get(&Key::from(key)).await?;
            g.bytes().await
        });
        r.ok().map(|b| b.to_vec())
    }

    pub fn delete(&self, key: &str) {
        self.rt
            .block_on(self.store.delete(&Key::from(key)))
            .unwrap();
    }

    /// Every key in the bucket, sorted.
    pub fn keys(&self) -> Vec<String> {
        use futures_util::StreamExt as _;
        let mut v: Vec<String> = self.rt.block_on(async {
            let mut out = Vec::new();
            let mut s = self.store.list(None);
            while let Some(m) = s.next().await {
                out.push(m.unwrap().location.to_string());
            }
            out
        });
        v.sort();
        v
    }

    /// The environment a child `unshard` needs to reach the server.
    pub fn env(&self, cmd: &mut Command) {
        self.env_via(cmd, &self.endpoint);
    }

    /// The environment a child `unshard` needs to reach the server through
    /// `endpoint` (a proxy in front of it, say). Azurite is reached as its users
    /// reach it: the emulator switch and its URL.
    pub fn env_via(&self, cmd: &mut Command, endpoint: &str) {
        match self.server {
            Server::S3 => cmd
                .env("AWS_ENDPOINT_URL", endpoint)
                .env("AWS_ALLOW_HTTP", "true")
                .env("AWS_ACCESS_KEY_ID", "test")
                .env("AWS_SECRET_ACCESS_KEY", "test")
                .env("AWS_REGION", "us-east-1")
                .env_remove("AWS_PROFILE")
                .env_remove("AWS_SESSION_TOKEN"),
            Server::Azure => cmd
                .env("AZURE_STORAGE_USE_EMULATOR", "true")
                .env("AZURITE_BLOB_STORAGE_URL", endpoint)
                .env_remove("AZURE_STORAGE_ACCOUNT_NAME")
                .env_remove("AZURE_STORAGE_ACCOUNT_KEY"),
        };
    }
}

/// An HTTP date (`Fri, 04 Dec 2026 10:00:00 GMT`), as Shared Key signing wants it.
fn http_date(t: std::time::SystemTime) -> String {
    let secs = t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Days since 1970-01-01 to a civil date (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    const WEEKDAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    format!(
        "{}, {day:02} {} {year} {:02}:{:02}:{:02} GMT",
        WEEKDAYS[days.rem_euclid(7) as usize],
        MONTHS[(month - 1) as usize],
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// A bucket name unique to this process and test (S3 names: lowercase, digits, '-').
pub fn bucket_name(test: &str) -> String {
    let t: String = test
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    // Azure container names allow no two hyphens in a row.
    let mut t = t;
    while t.contains("--") {
        t = t.replace("--", "-");
    }
    let mut name = format!("t{}-{}", std::process::id(), t);
    name.truncate(60);
    name.trim_end_matches('-').to_string()
}
