//! `unshard._unshard`: the extension module behind the `unshard` Python package.
//!
//! A thin layer: options arrive as JSON (built by `python/unshard/_api.py`, which
//! owns the Python signatures), reports leave as the JSON the CLI prints with
//! `--json`, and errors as `NativeError(kind, message, hint)`, which the Python
//! side turns into the matching `UnshardError` subclass. The work itself runs off
//! the GIL (see the `job` module).

use pyo3::exceptions::PyException;
use pyo3::prelude::*;

mod job;
mod options;

pyo3::create_exception!(
    _unshard,
    NativeError,
    PyException,
    "An error from unshard: args are (kind, message, hint)."
);

/// Turns a library error into `NativeError(kind, message, hint)`.
fn to_py(e: &unshard::Error) -> PyErr {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        message.push_str(&format!("\n  caused by: {s}"));
        source = s.source();
    }
    NativeError::new_err((
        options::kind_of(e),
        options::keywords(&message),
        options::hint_of(e),
    ))
}

/// Runs the `unshard` command line with `argv` (argv[0] is the program name) and
/// returns its exit code: what the console script and `python -m unshard` call.
#[pyfunction]
fn run_cli(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| i32::from(unshard_cli::run(argv)))
}

/// Runs `work` off the GIL with fresh progress counters and a cancel token; its
/// JSON, or the error as `NativeError`, or the Python exception that stopped it.
fn run_json<F>(py: Python<'_>, progress: Option<Bound<'_, PyAny>>, work: F) -> PyResult<String>
where
    F: FnOnce(&dyn unshard::Progress, &unshard::Cancel) -> Result<String, unshard::Error> + Send,
{
    let counters = job::Counters::default();
    let cancel = unshard::Cancel::new();
    let reporter = options::Reporter::new(&counters);
    let result = job::run(
        py,
        &counters,
        progress.as_ref(),
        &|| cancel.cancel(),
        || work(&reporter, &cancel),
    )?;
    result.map_err(|e| to_py(&e))
}

/// Merges; see `unshard.merge`.
#[pyfunction]
#[pyo3(signature = (checkpoint, output, options_json, progress))]
fn merge(
    py: Python<'_>,
    checkpoint: String,
    output: String,
    options_json: &str,
    progress: Option<Bound<'_, PyAny>>,
) -> PyResult<String> {
    let request =
        options::MergeRequest::parse(&checkpoint, &output, options_json).map_err(|e| to_py(&e))?;
    run_json(py, progress, |p, c| request.run(p, c))
}

/// Describes an input; see `unshard.inspect`.
#[pyfunction]
#[pyo3(signature = (path, key, tag, stats, progress))]
fn inspect(
    py: Python<'_>,
    path: String,
    key: Option<String>,
    tag: Option<String>,
    stats: bool,
    progress: Option<Bound<'_, PyAny>>,
) -> PyResult<String> {
    run_json(py, progress, |_, c| {
        options::inspect(&path, key, tag, stats, c)
    })
}

/// Verifies an output; see `unshard.verify`.
#[pyfunction]
#[pyo3(signature = (output, against, options_json, progress))]
fn verify(
    py: Python<'_>,
    output: String,
    against: String,
    options_json: &str,
    progress: Option<Bound<'_, PyAny>>,
) -> PyResult<String> {
    let request =
        options::MergeRequest::parse(&against, &output, options_json).map_err(|e| to_py(&e))?;
    run_json(py, progress, |p, c| request.verify(p, c))
}

/// Compares two inputs; see `unshard.diff`.
#[pyfunction]
#[pyo3(signature = (a, b, refuse_unsafe, progress))]
fn diff(
    py: Python<'_>,
    a: String,
    b: String,
    refuse_unsafe: bool,
    progress: Option<Bound<'_, PyAny>>,
) -> PyResult<String> {
    run_json(py, progress, |p, c| {
        options::diff(&a, &b, refuse_unsafe, p, c)
    })
}

/// The module.
#[pymodule]
fn _unshard(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("NativeError", m.py().get_type::<NativeError>())?;
    m.add_function(wrap_pyfunction!(run_cli, m)?)?;
    m.add_function(wrap_pyfunction!(merge, m)?)?;
    m.add_function(wrap_pyfunction!(inspect, m)?)?;
    m.add_function(wrap_pyfunction!(verify, m)?)?;
    m.add_function(wrap_pyfunction!(diff, m)?)?;
    Ok(())
}
