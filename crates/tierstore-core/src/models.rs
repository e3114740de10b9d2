//! The model repository's side of the core: pack files, where the repository keeps tensors
//! ([`pack`], written, and [`load`], read and checked), and model streaming's placement of a version's
//! tensors in the agent's shared memory ([`stream`]) and the manifest of a streamed version
//! ([`manifest`]). The repository's versions, manifests and deduplication are shaped in Python
//! (`tierstore.models`); the bytes go through here.

pub mod load;
pub mod manifest;
pub mod pack;
pub mod stream;
