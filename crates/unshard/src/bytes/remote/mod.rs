//! Object storage (the `remote` feature): checkpoints, base directories and outputs
//! at `s3://`, `gs://`, `az://` / `abfss://` and `http(s)://` URLs, through the
//! `object_store` crate.
//!
//! A URL stands wherever a path does: it travels through the library as a `PathBuf`
//! holding the URL text (`Path::join` appends keys as it appends file names), and
//! [`crate::bytes::fs`] sends each file-system question (what is this, list it,
//! read it, open it) here when the path is a URL. A "directory" is a key prefix.
//!
//! - [`store`]: from a URL to a client and a key; the request runtime; listings.
//! - [`profile`]: AWS profiles (`~/.aws/credentials`, `~/.aws/config`).
//! - [`source`]: an object as a [`crate::bytes::ByteSource`] (ranged GETs, many in flight).
//!
//! The output side, an output prefix as a `Sink` (multipart uploads, the index and
//! config last, undone on failure), is `write::bucket`, beside the other sinks.

#[cfg(test)]
pub(crate) mod cut;
pub mod profile;
pub mod source;
pub mod store;
#[cfg(test)]
mod tests;

pub use source::ObjectSource;
pub use store::locate;
#[cfg(feature = "internals")]
pub use store::Location;
