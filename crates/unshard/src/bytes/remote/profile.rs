//! AWS profiles, read as the AWS CLI reads them: the `object_store` crate takes its
//! S3 settings from `AWS_*` variables only, so a user whose keys, region or
//! S3-compatible endpoint live in `~/.aws/credentials` and `~/.aws/config` would
//! otherwise have to export them first.
//!
//! - The profile is `AWS_PROFILE` (else `default`). Files: `AWS_SHARED_CREDENTIALS_FILE`
//!   (else `~/.aws/credentials`, sections `[name]`) and `AWS_CONFIG_FILE` (else
//!   `~/.aws/config`, sections `[default]` and `[profile name]`).
//! - Keys (`aws_access_key_id`, `aws_secret_access_key`, `aws_session_token`): the
//!   credentials file's, else the config file's.
//! - `region`; the endpoint: the S3 `endpoint_url` of the profile's `services`
//!   section, else the profile's `endpoint_url`; `s3 =` sub-keys
//!   (`addressing_style = virtual`).
//! - Environment variables win over the files, key by key group (keys, region,
//!   endpoint), as in the CLI.
//! - Profiles that get their credentials another way (`role_arn`, `sso_*`,
//!   `credential_process`) are not run: an error says how to export the keys.
//!   A profile named in `AWS_PROFILE` that neither file has is an error too.
//!
//! The files are INI as Python's `configparser` reads them (what the CLI uses):
//! `#` and `;` start comment lines (not inline comments), keys are
//! case-insensitive, indented lines under a key with an empty value are its
//! sub-keys.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// One INI file: section name to keys (sub-keys as `parent.key`), keys lowercase.
type Sections = BTreeMap<String, BTreeMap<String, String>>;

/// Parses an AWS CLI config or credentials file (see the module docs).
fn parse(text: &str) -> Sections {
    let mut out = Sections::new();
    let mut section: Option<String> = None;
    let mut parent: Option<String> = None;
    for raw in text.lines() {
        let line = raw.trim_end();
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') || trimmed.starts_with(';') {
            continue;
        }
        let indented = line.len() != trimmed.len();
        if !indented && trimmed.starts_with('[') {
            section = trimmed
                .strip_prefix('[')
                .and_then(|s| s.strip_suffix(']'))
                .map(|s| s.trim().to_string());
            parent = None;
            continue;
        }
        let Some(sec) = &section else {
            continue;
        };
        let Some((k, v)) = trimmed.split_once('=') else {
            continue;
        };
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim().to_string());
        let keys = out.entry(sec.clone()).or_default();
        match (&parent, indented) {
            (Some(p), true) => {
                keys.insert(format!("{p}.{k}"), v);
            }
            // The continuation of a value (multi-line values are not used here).
            (None, true) => {}
            (_, false) => {
                parent = v.is_empty().then(|| k.clone());
                keys.insert(k, v);
            }
        }
    }
    out
}

/// What a profile sets for S3.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Profile {
    /// The profile's name.
    pub name: String,
    /// Access key id, secret key and session token (when the profile has keys).
    pub keys: Option<(String, String, Option<String>)>,
    /// `region`.
    pub region: Option<String>,
    /// The S3 endpoint (`services` section, else `endpoint_url`).
    pub endpoint: Option<String>,
    /// `s3 = addressing_style = virtual`.
    pub virtual_hosted: bool,
}

fn file(env: &dyn Fn(&str) -> Option<String>, var: &str, name: &str) -> Option<PathBuf> {
    if let Some(p) = env(var).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let home = env("HOME").or_else(|| env("USERPROFILE"))?;
    Some(Path::new(&home).join(".aws").join(name))
}

fn read(path: &Option<PathBuf>) -> Result<Sections> {
    let Some(path) = path else {
        return Ok(Sections::new());
    };
    match std::fs::read(path) {
        Ok(b) => Ok(parse(&String::from_utf8_lossy(&b))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Sections::new()),
        Err(e) => Err(Error::io("read", path, e)),
    }
}

/// The profile `AWS_PROFILE` names (or `default`) from the files the environment
/// points to; `None` when there is no such profile and none was asked for.
pub fn load(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Profile>> {
    let asked = env("AWS_PROFILE").filter(|p| !p.is_empty());
    let name = asked.clone().unwrap_or_else(|| "default".into());
    let cred_path = file(env, "AWS_SHARED_CREDENTIALS_FILE", "credentials");
    let conf_path = file(env, "AWS_CONFIG_FILE", "config");
    let creds = read(&cred_path)?;
    let conf = read(&conf_path)?;
    let in_creds = creds.get(&name);
    let conf_section = if name == "default" {
        "default".to_string()
    } else {
        format!("profile {name}")
    };
    let in_conf = conf.get(&conf_section);
    if in_creds.is_none() && in_conf.is_none() {
        let shown =
            |p: &Option<PathBuf>| p.as_ref().map_or("-".into(), |p| p.display().to_string());
        return match asked {
            Some(_) => Err(Error::Unsupported {
                path: conf_path.clone().unwrap_or_default(),
                what: format!(
                    "AWS profile {name:?}: neither {} nor {} has it",
                    shown(&cred_path),
                    shown(&conf_path)
                ),
                hint: Some(
                    "check AWS_PROFILE, or AWS_SHARED_CREDENTIALS_FILE and AWS_CONFIG_FILE".into(),
                ),
            }),
            None => Ok(None),
        };
    }
    let get = |k: &str| -> Option<String> {
        in_creds
            .and_then(|s| s.get(k))
            .or_else(|| in_conf.and_then(|s| s.get(k)))
            .filter(|v| !v.is_empty())
            .cloned()
    };
    let keys = match (get("aws_access_key_id"), get("aws_secret_access_key")) {
        (Some(id), Some(secret)) => Some((id, secret, get("aws_session_token"))),
        _ => None,
    };
    if keys.is_none() {
        let other = [
            "role_arn",
            "credential_process",
            "sso_session",
            "sso_start_url",
        ]
        .into_iter()
        .find(|k| get(k).is_some());
        if let Some(k) = other {
            return Err(Error::Unsupported {
                path: conf_path.unwrap_or_default(),
                what: format!("AWS profile {name:?} gets its credentials through {k}, which unshard does not run"),
                hint: Some(format!(
                    "export the credentials first: eval \"$(aws configure export-credentials --profile {name} --format env)\""
                )),
            });
        }
    }
    let conf_get = |k: &str| {
        in_conf
            .and_then(|s| s.get(k))
            .filter(|v| !v.is_empty())
            .cloned()
    };
    let service_endpoint = conf_get("services").and_then(|s| {
        conf.get(&format!("services {s}"))
            .and_then(|sec| sec.get("s3.endpoint_url"))
            .cloned()
    });
    Ok(Some(Profile {
        name,
        keys,
        region: conf_get("region"),
        endpoint: service_endpoint.or_else(|| conf_get("endpoint_url")),
        virtual_hosted: conf_get("s3.addressing_style").is_some_and(|s| s == "virtual"),
    }))
}

/// The S3 settings `(object_store config key, value)` to add to what the
/// environment sets: a group of settings is taken from the profile only when no
/// variable sets it.
pub fn settings(
    profile: &Profile,
    env: &dyn Fn(&str) -> Option<String>,
) -> Vec<(&'static str, String)> {
    let set = |vars: &[&str]| vars.iter().any(|v| env(v).is_some_and(|x| !x.is_empty()));
    let mut out = Vec::new();
    if let Some((id, secret, token)) = &profile.keys {
        if !set(&["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]) {
            out.push(("aws_access_key_id", id.clone()));
            out.push(("aws_secret_access_key", secret.clone()));
            if let Some(t) = token {
                out.push(("aws_session_token", t.clone()));
            }
        }
    }
    if let Some(r) = &profile.region {
        if !set(&["AWS_REGION", "AWS_DEFAULT_REGION"]) {
            out.push(("aws_region", r.clone()));
        }
    }
    if let Some(e) = &profile.endpoint {
        if !set(&["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"]) {
            out.push(("aws_endpoint", e.clone()));
            if e.starts_with("http://") {
                out.push(("aws_allow_http", "true".into()));
            }
        }
    }
    if profile.virtual_hosted && !set(&["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"]) {
        out.push(("aws_virtual_hosted_style_request", "true".into()));
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A home directory with `.aws/credentials` and `.aws/config`, and an
    /// environment of `vars` (HOME pointing there).
    struct Home {
        dir: tempfile::TempDir,
        vars: HashMap<String, String>,
    }

    impl Home {
        fn new(credentials: &str, config: &str) -> Home {
            let dir = tempfile::tempdir().unwrap();
            std::fs::create_dir(dir.path().join(".aws")).unwrap();
            std::fs::write(dir.path().join(".aws/credentials"), credentials).unwrap();
            std::fs::write(dir.path().join(".aws/config"), config).unwrap();
            let mut vars = HashMap::new();
            vars.insert("HOME".into(), dir.path().to_str().unwrap().to_string());
            Home { dir, vars }
        }
        fn with(mut self, k: &str, v: &str) -> Home {
            self.vars.insert(k.into(), v.into());
            self
        }
        fn env(&self) -> impl Fn(&str) -> Option<String> + '_ {
            |k| self.vars.get(k).cloned()
        }
        fn load(&self) -> Result<Option<Profile>> {
            load(&self.env())
        }
    }

    const CREDENTIALS: &str = "\
# keys
[default]
aws_access_key_id = AKIDDEFAULT
aws_secret_access_key = secret/default+key

[dev]
AWS_Access_Key_Id=AKIDDEV
aws_secret_access_key=devsecret
aws_session_token = tok;en # not a comment
";

    const CONFIG: &str = "\
[default]
region = eu-west-1

; the dev profile talks to a MinIO
[profile dev]
region = us-east-2
services = local
s3 =
  addressing_style = virtual

[services local]
s3 =
  endpoint_url = http://127.0.0.1:9000

[profile keys-in-config]
aws_access_key_id = AKIDCONF
aws_secret_access_key = confsecret
endpoint_url = https://s3.example.com

[profile role]
role_arn = arn:aws:iam::123:role/x
source_profile = default
";

    #[test]
    fn the_default_profile_takes_keys_from_credentials_and_region_from_config() {
        let h = Home::new(CREDENTIALS, CONFIG);
        let p = h.load().unwrap().unwrap();
        assert_eq!(
            p,
            Profile {
                name: "default".into(),
                keys: Some(("AKIDDEFAULT".into(), "secret/default+key".into(), None)),
                region: Some("eu-west-1".into()),
                endpoint: None,
                virtual_hosted: false,
            }
        );
    }

    #[test]
    fn a_named_profile_with_a_services_endpoint_and_sub_keys() {
        let h = Home::new(CREDENTIALS, CONFIG).with("AWS_PROFILE", "dev");
        let p = h.load().unwrap().unwrap();
        // Keys are case-insensitive; `;` and `#` inside a value are kept, as
        // configparser keeps them.
        assert_eq!(
            p.keys,
            Some((
                "AKIDDEV".into(),
                "devsecret".into(),
                Some("tok;en # not a comment".into())
            ))
        );
        assert_eq!(p.region.as_deref(), Some("us-east-2"));
        assert_eq!(p.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert!(p.virtual_hosted);
        let s = settings(&p, &h.env());
        assert!(s.contains(&("aws_endpoint", "http://127.0.0.1:9000".into())));
        assert!(s.contains(&("aws_allow_http", "true".into())));
        assert!(s.contains(&("aws_session_token", "tok;en # not a comment".into())));
        assert!(s.contains(&("aws_virtual_hosted_style_request", "true".into())));
        // Every setting is one object_store's S3 builder takes.
        for (k, _) in &s {
            assert!(
                k.parse::<object_store::aws::AmazonS3ConfigKey>().is_ok(),
                "{k}"
            );
        }
    }

    #[test]
    fn keys_may_live_in_the_config_file_and_files_may_be_elsewhere() {
        let h = Home::new("", "");
        let other = h.dir.path().join("conf");
        std::fs::write(&other, CONFIG).unwrap();
        let h = h
            .with("AWS_CONFIG_FILE", other.to_str().unwrap())
            .with("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
            .with("AWS_PROFILE", "keys-in-config");
        let p = h.load().unwrap().unwrap();
        assert_eq!(p.keys, Some(("AKIDCONF".into(), "confsecret".into(), None)));
        assert_eq!(p.endpoint.as_deref(), Some("https://s3.example.com"));
        // An https endpoint needs no plain-http switch, and a profile that does not
        // ask for virtual-hosted requests gets none.
        assert!(!settings(&p, &h.env())
            .iter()
            .any(|(k, _)| *k == "aws_allow_http" || *k == "aws_virtual_hosted_style_request"));
    }

    #[test]
    fn the_credentials_file_wins_over_the_config_file() {
        let h = Home::new(
            "[default]\naws_access_key_id = FROMCREDS\naws_secret_access_key = s1\n",
            "[default]\naws_access_key_id = FROMCONF\naws_secret_access_key = s2\n",
        );
        let p = h.load().unwrap().unwrap();
        assert_eq!(p.keys, Some(("FROMCREDS".into(), "s1".into(), None)));
    }

    #[test]
    fn variables_win_over_the_profile_group_by_group() {
        let h = Home::new(CREDENTIALS, CONFIG)
            .with("AWS_PROFILE", "dev")
            .with("AWS_ACCESS_KEY_ID", "ENV")
            .with("AWS_SECRET_ACCESS_KEY", "ENVSECRET")
            .with("AWS_ENDPOINT_URL", "http://127.0.0.1:5000");
        let p = h.load().unwrap().unwrap();
        let s = settings(&p, &h.env());
        let keys: Vec<&str> = s.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, ["aws_region", "aws_virtual_hosted_style_request"]);
    }

    #[test]
    fn no_files_and_no_profile_asked_for_is_nothing() {
        let h = Home::new("", "");
        assert_eq!(h.load().unwrap(), None);
        let none = |_: &str| None;
        assert_eq!(load(&none).unwrap(), None);
    }

    #[test]
    fn a_profile_asked_for_and_missing_is_an_error_naming_both_files() {
        let h = Home::new(CREDENTIALS, CONFIG).with("AWS_PROFILE", "prod");
        let e = h.load().unwrap_err().to_string();
        assert!(
            e.contains("\"prod\"") && e.contains(".aws/credentials") && e.contains(".aws/config"),
            "{e}"
        );
    }

    #[test]
    fn a_role_profile_is_refused_with_the_command_that_exports_its_keys() {
        let h = Home::new(CREDENTIALS, CONFIG).with("AWS_PROFILE", "role");
        let e = h.load().unwrap_err();
        assert!(e.to_string().contains("role_arn"), "{e}");
        assert!(e
            .hint()
            .unwrap_or_default()
            .contains("export-credentials --profile role"));
    }

    #[test]
    fn sections_keys_and_sub_keys_parse_as_configparser_does() {
        let s = parse("top = ignored\n[a]\n# c1 = hash\n; c2 = semicolon\nk = v = w\n  indented = x\nempty =\n  sub = 1\n  other=2\nnext = 3\n[ b ]\nK=4\n");
        assert_eq!(s["a"]["k"], "v = w");
        // An indented line under a key with a value is not a sub-key here.
        assert!(!s["a"].contains_key("k.indented") && !s["a"].contains_key("indented"));
        assert_eq!(s["a"]["empty.sub"], "1");
        assert_eq!(s["a"]["empty.other"], "2");
        assert_eq!(s["a"]["next"], "3");
        assert_eq!(s["b"]["k"], "4");
        assert_eq!(s.len(), 2);
        // Comment lines are skipped even when they hold an `=`.
        assert!(
            !s["a"].contains_key("# c1") && !s["a"].contains_key("; c2"),
            "{s:?}"
        );
    }

    #[test]
    fn a_file_that_cannot_be_read_is_an_error_naming_it() {
        let h = Home::new(CREDENTIALS, CONFIG);
        let dir = h.dir.path().join(".aws");
        let h = h.with("AWS_SHARED_CREDENTIALS_FILE", dir.to_str().unwrap());
        let e = h.load().unwrap_err();
        assert!(e.to_string().contains(dir.to_str().unwrap()), "{e}");
    }
}
