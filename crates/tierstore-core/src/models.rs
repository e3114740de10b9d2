//! The model repository's side of the core: pack files, where the repository keeps tensors ([`pack`],
//! written, and [`load`], read and checked); model streaming's placement of a version's tensors in the
//! agent's shared memory ([`stream`]); the manifests of a streamed version and of a repository's version
//! ([`manifest`]); and the requests a stream connection carries ([`requests`]). The repository's versions
//! and deduplication are shaped in Python (`tierstore.models`); the bytes and the schemas are here.

pub mod load;
pub mod manifest;
pub mod pack;
pub mod requests;
pub mod stream;
