//! An AWS profile in place of `AWS_*` variables: keys, region and the endpoint of
//! the S3-compatible test server (moto_server, started by `.ci/run`) come from
//! `AWS_CONFIG_FILE` and `AWS_SHARED_CREDENTIALS_FILE` alone.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

use common::fixtures;
use common::s3::{bucket_name, endpoint, Bucket};

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn a_profile_from_the_aws_files_reaches_the_server() {
    let ep = endpoint("aws-profile");
    let b = Bucket::create(&ep, &bucket_name("aws-profile"));
    b.upload(
        &fixtures().join("ckpt/llama_policy.pt"),
        "ckpt/llama_policy.pt",
    );
    let tmp = tempfile::tempdir().unwrap();
    let (creds, conf) = (tmp.path().join("credentials"), tmp.path().join("config"));
    std::fs::write(
        &creds,
        "[default]\naws_access_key_id = nope\naws_secret_access_key = nope\n\n[bench]\naws_access_key_id = test\naws_secret_access_key = test\n",
    )
    .unwrap();
    std::fs::write(
        &conf,
        format!("[profile bench]\nregion = us-east-1\nservices = local\n\n[services local]\ns3 =\n  endpoint_url = {ep}\n"),
    )
    .unwrap();
    let run = |profile: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_unshard"));
        for v in [
            "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3",
            "AWS_ALLOW_HTTP",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "AWS_REGION",
            "AWS_DEFAULT_REGION",
            "AWS_PROFILE",
        ] {
            cmd.env_remove(v);
        }
        if let Some(p) = profile {
            cmd.env("AWS_PROFILE", p);
        }
        cmd.env("AWS_CONFIG_FILE", &conf)
            .env("AWS_SHARED_CREDENTIALS_FILE", &creds)
            .args(["inspect", &b.url("ckpt/llama_policy.pt")])
            .output()
            .unwrap()
    };
    let o = run(Some("bench"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("embed_tokens"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    // A profile neither file has is named in the error.
    let o = run(Some("missing"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("\"missing\""), "{err}");
}
