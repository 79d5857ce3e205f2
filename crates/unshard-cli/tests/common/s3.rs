//! A real S3-compatible server for the object-storage tests: `.ci/run` starts
//! `moto_server` on a loopback port and exports `UNSHARD_TEST_S3_ENDPOINT`. Fixtures
//! are uploaded with the `object_store` crate's own client (not unshard's code), each
//! test in a bucket of its own.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use object_store::aws::AmazonS3Builder;
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

/// A bucket on the test server, created empty for one test.
pub struct Bucket {
    pub endpoint: String,
    pub name: String,
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
        Bucket {
            endpoint: endpoint.to_string(),
            name: name.to_string(),
            store: Arc::new(store),
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
        }
    }

    /// `s3://bucket/key`.
    pub fn url(&self, key: &str) -> String {
        format!("s3://{}/{}", self.name, key)
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
        cmd.env("AWS_ENDPOINT_URL", &self.endpoint)
            .env("AWS_ALLOW_HTTP", "true")
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_REGION", "us-east-1")
            .env_remove("AWS_PROFILE")
            .env_remove("AWS_SESSION_TOKEN");
    }
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
    let mut name = format!("t{}-{}", std::process::id(), t);
    name.truncate(60);
    name.trim_end_matches('-').to_string()
}
