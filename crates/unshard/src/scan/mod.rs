//! Code a checkpoint would run under `torch.load`, found without running anything.
//!
//! unshard never executes a pickle, but a file that carries a code-execution payload
//! is a compromised file, and whoever is about to publish a model from it must be
//! told. This module owns what is reported and how it is found in any file:
//! [`UnsafeCall`] (one callable outside the allowlist of `unshard_pickle::audit`, with
//! the file, the record or pickle it sits in, the route and the offset), and
//! [`scan_paths`], the walk behind `unshard scan`, which also reads files unshard
//! would not merge (bare pickles, `.distcp` files on their own, any zip archive)
//! so that it can serve as a pre-upload or CI check.
//!
//! Readers that parse a pickle anyway call `source::audit::audit_pickle` on it, so
//! reading commands report the same findings without parsing twice.

mod files;
mod trainer;

use std::path::{Path, PathBuf};

pub use crate::source::audit::{audit_pickle, UnsafeCall};
pub use files::scan_file;

/// What `unshard scan` found in one file.
#[derive(Clone, Debug, Default)]
pub struct FileScan {
    /// The file.
    pub path: PathBuf,
    /// What the file was read as (`torch.save zip archive`, `bare pickle`, ...).
    pub kind: String,
    /// Pickles read in the file.
    pub pickles: usize,
    /// What its pickles would run under `torch.load`.
    pub unsafe_calls: Vec<UnsafeCall>,
    /// Calls that run under `torch.load` but only rebuild a Trainer's arguments
    /// (`training_args.bin`: dataclasses created without their constructors, enum
    /// lookups): listed, not counted as unsafe.
    pub recognised: Vec<UnsafeCall>,
    /// Findings beyond the per-pickle bound, not listed.
    pub omitted: usize,
    /// Why part of the file could not be read, or an ambiguity that makes two readers
    /// see different contents (duplicate zip records). Code before a broken opcode is
    /// still reported: `pickle.load` runs it before failing.
    pub problems: Vec<String>,
}

impl FileScan {
    /// Nothing outside the allowlist and nothing unreadable.
    pub fn is_clean(&self) -> bool {
        self.unsafe_calls.is_empty() && self.omitted == 0 && self.problems.is_empty()
    }
}

/// Deepest directory level [`scan_paths`] descends to.
const MAX_DIR_DEPTH: usize = 32;

/// Scans files, and directories recursively (in name order; symbolic links to
/// directories are not followed, so a loop cannot trap the walk). Files that cannot
/// hold a pickle (safetensors, JSON, text) are listed as such.
pub fn scan_paths(paths: &[PathBuf]) -> Vec<FileScan> {
    let mut out = Vec::new();
    for path in paths {
        walk(path, 0, &mut out);
    }
    out
}

fn walk(path: &Path, depth: usize, out: &mut Vec<FileScan>) {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) => {
            out.push(FileScan {
                path: path.to_path_buf(),
                kind: "unreadable".into(),
                problems: vec![format!("cannot read it: {e}")],
                ..FileScan::default()
            });
            return;
        }
    };
    let is_dir = meta.is_dir() || (meta.is_symlink() && depth == 0 && path.is_dir());
    if !is_dir {
        if meta.is_file() || (meta.is_symlink() && path.is_file()) {
            out.push(scan_file(path));
        }
        return;
    }
    if depth >= MAX_DIR_DEPTH {
        return;
    }
    let mut entries: Vec<PathBuf> = match std::fs::read_dir(path) {
        Ok(rd) => rd.filter_map(|e| e.ok()).map(|e| e.path()).collect(),
        Err(e) => {
            out.push(FileScan {
                path: path.to_path_buf(),
                kind: "unreadable directory".into(),
                problems: vec![format!("cannot list it: {e}")],
                ..FileScan::default()
            });
            return;
        }
    };
    entries.sort();
    for entry in entries {
        walk(&entry, depth + 1, out);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Regular files below `dir`, counted by the standard library alone.
    fn count_files(dir: &Path) -> usize {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .map(|p| if p.is_dir() { count_files(&p) } else { 1 })
            .sum()
    }

    /// The hostile corpus as `fixtures/gen_hostile.py` describes it: every file
    /// below the directory is scanned once; what the generator calls unsafe or
    /// unknown is not clean and names its callables; its clean files are clean; its
    /// archives with two records of one name are not clean, with no call to report.
    #[test]
    fn a_directory_is_walked_and_each_file_judged_as_the_generator_says() {
        let dir = crate::fixtures().join("hostile");
        let scans = scan_paths(std::slice::from_ref(&dir));
        assert_eq!(scans.len(), count_files(&dir));
        let text = std::fs::read_to_string(dir.join("manifest.json")).unwrap();
        let manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
        let mut seen = 0;
        for case in manifest["cases"].as_array().unwrap() {
            let file = case["file"].as_str().unwrap();
            // A case is a file or a directory (a DCP checkpoint) of several.
            let case_path = dir.join(file);
            let of_case: Vec<&FileScan> = scans
                .iter()
                .filter(|s| s.path.starts_with(&case_path))
                .collect();
            assert!(!of_case.is_empty(), "{file}");
            let called: Vec<&str> = of_case
                .iter()
                .flat_map(|s| s.unsafe_calls.iter().map(|c| c.callable.as_str()))
                .collect();
            match case["expect"].as_str().unwrap() {
                "unsafe" | "unknown" => {
                    assert!(of_case.iter().any(|s| !s.is_clean()), "{file}");
                    for want in case["callables"].as_array().unwrap() {
                        let want = want.as_str().unwrap();
                        assert!(
                            called.iter().any(|c| c.contains(want)),
                            "{file}: {want} not in {called:?}"
                        );
                    }
                }
                "clean" => {
                    assert!(of_case.iter().all(|s| s.is_clean()), "{file}: {of_case:?}")
                }
                _ => {}
            }
            if case["route"]
                .as_str()
                .unwrap()
                .starts_with("duplicate zip entry")
                || case["route"] == "two data.pkl records"
            {
                let s = of_case[0];
                assert!(called.is_empty(), "{file}: {called:?}");
                assert!(!s.is_clean(), "{file}: {s:?}");
                assert!(
                    s.problems.iter().any(|p| p.contains("two records named")),
                    "{file}: {s:?}"
                );
            }
            seen += 1;
        }
        assert!(seen >= 120, "{seen}");
    }

    /// A path that does not exist is reported as such, under its name.
    #[test]
    fn a_missing_path_is_a_problem_of_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.pt");
        let scans = scan_paths(std::slice::from_ref(&missing));
        assert_eq!(scans.len(), 1, "{scans:?}");
        assert_eq!(scans[0].path, missing);
        assert_eq!(scans[0].kind, "unreadable");
        assert!(
            scans[0].problems[0].starts_with("cannot read it: "),
            "{scans:?}"
        );
        assert!(!scans[0].is_clean());
    }

    /// A directory that cannot be listed is reported under its path as an
    /// unreadable directory, with the reason, and is not clean. Listing needs a file
    /// descriptor, so a process that has none left cannot list any directory, root
    /// included (permission bits do not stop root). That process is this test binary
    /// run again on this test alone, with a variable naming the directory: it lowers
    /// its own limit on open files, which the other tests do not share.
    #[cfg(unix)]
    #[test]
    fn a_directory_that_cannot_be_listed_is_reported_as_such() {
        const DIR: &str = "UNSHARD_TEST_SCAN_UNLISTABLE";
        if let Some(dir) = std::env::var_os(DIR) {
            let dir = PathBuf::from(dir);
            let mut lim = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit only writes the struct it is given.
            assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
            // The lowest free descriptor: with the limit there, no file opens.
            let free = {
                use std::os::fd::AsRawFd;
                std::fs::File::open("/dev/null").unwrap().as_raw_fd()
            };
            let none_left = libc::rlimit {
                rlim_cur: libc::rlim_t::try_from(free).unwrap(),
                rlim_max: lim.rlim_max,
            };
            // SAFETY: setrlimit only reads the struct it is given.
            assert_eq!(
                unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &none_left) },
                0
            );
            let scans = scan_paths(std::slice::from_ref(&dir));
            // SAFETY: as above.
            assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
            let emfile = std::io::Error::from_raw_os_error(libc::EMFILE);
            assert_eq!(scans.len(), 1, "{scans:?}");
            assert_eq!(scans[0].path, dir);
            assert_eq!(scans[0].kind, "unreadable directory");
            assert_eq!(scans[0].problems, [format!("cannot list it: {emfile}")]);
            assert!(!scans[0].is_clean());
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        std::fs::copy(
            crate::fixtures().join("hostile/metrics_os_system.pt"),
            tmp.path().join("a.pt"),
        )
        .unwrap();
        let module = module_path!().split_once("::").unwrap().1;
        let name = format!("{module}::a_directory_that_cannot_be_listed_is_reported_as_such");
        let o = std::process::Command::new(std::env::current_exe().unwrap())
            .args([name.as_str(), "--exact", "--test-threads=1"])
            .env(DIR, tmp.path())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(stdout.contains("test result: ok. 1 passed"), "{stdout}");
    }

    /// A symbolic link given on the command line is followed (to a directory or a
    /// file); one met inside a directory is followed to a file but not to a
    /// directory, so a link back up cannot loop the walk. Nothing is scanned below
    /// the depth limit.
    #[cfg(unix)]
    #[test]
    fn links_are_followed_from_the_command_line_and_to_files_only_inside() {
        use std::os::unix::fs::symlink;
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let payload = crate::fixtures().join("hostile/metrics_os_system.pt");
        std::fs::copy(&payload, root.join("a.pt")).unwrap();
        symlink(&payload, root.join("b.pt")).unwrap();
        symlink(&root, root.join("up")).unwrap();
        symlink(tmp.path().join("gone"), root.join("dangling.pt")).unwrap();
        let link = tmp.path().join("link");
        symlink(&root, &link).unwrap();

        for top in [&root, &link] {
            let scans = scan_paths(std::slice::from_ref(top));
            let names: Vec<String> = scans
                .iter()
                .map(|s| s.path.file_name().unwrap().to_string_lossy().into_owned())
                .collect();
            assert_eq!(names, ["a.pt", "b.pt"], "{scans:?}");
            assert!(scans.iter().all(|s| !s.is_clean()), "{scans:?}");
        }
        let file_link = tmp.path().join("file_link.pt");
        symlink(&payload, &file_link).unwrap();
        let scans = scan_paths(std::slice::from_ref(&file_link));
        assert_eq!(scans.len(), 1);
        assert_eq!(scans[0].path, file_link);
        assert!(!scans[0].unsafe_calls.is_empty(), "{scans:?}");

        // 40 levels of directories, a payload at every level.
        let mut deep = tmp.path().join("deep");
        for _ in 0..40 {
            std::fs::create_dir_all(&deep).unwrap();
            std::fs::copy(&payload, deep.join("x.pt")).unwrap();
            deep = deep.join("d");
        }
        let scans = scan_paths(&[tmp.path().join("deep")]);
        assert_eq!(scans.len(), MAX_DIR_DEPTH, "{}", scans.len());
    }
}
