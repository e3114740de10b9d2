//! The wire protocol (its frames are `tierstore_core::cluster::wire`) over tokio's async streams.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub use tierstore_core::cluster::seal::{Seal, Seals, TAG};
pub use tierstore_core::cluster::wire::*;

/// Reads one frame; `Ok(None)` at a clean end of stream (between frames).
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> io::Result<Option<Frame>> {
    read_frame_within(r, MAX_FRAME).await
}

/// Reads one frame of at most `max` bytes (a hello, before its sender proved anything: [`MAX_HELLO`]);
/// a longer one is refused before anything is allocated for it.
pub async fn read_frame_within<R: AsyncRead + Unpin>(r: &mut R, max: usize) -> io::Result<Option<Frame>> {
    let mut prefix = [0u8; 4];
    match r.read_exact(&mut prefix).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = body_len(prefix).map_err(invalid)?;
    if len > max {
        return Err(invalid(FrameError::TooLong { len, max }));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    parse(&body).map(Some).map_err(invalid)
}

/// Writes one frame.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, frame: &Frame) -> io::Result<()> {
    write_sealed(w, &mut Seal::plain(), frame).await
}

/// Reads one frame under `seal` (see `tierstore_core::cluster::seal`), whole; `Ok(None)` at a clean end of
/// stream (between frames).
pub async fn read_sealed<R: AsyncRead + Unpin>(r: &mut R, seal: &mut Seal) -> io::Result<Option<Frame>> {
    let mut prefix = [0u8; 4 + TAG];
    match r.read_exact(&mut prefix[..4]).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = body_len(prefix[..4].try_into().expect("4 bytes")).map_err(invalid)?;
    let prefix = &mut prefix[..seal.prefix_len()];
    r.read_exact(&mut prefix[4..]).await?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    seal.open(prefix, &mut body).map(Some)
}

/// Writes one frame under `seal`.
pub async fn write_sealed<W: AsyncWrite + Unpin>(w: &mut W, seal: &mut Seal, frame: &Frame) -> io::Result<()> {
    let out = seal.bytes_of(frame);
    w.write_all(&out).await?;
    w.flush().await
}

/// A connection past its handshake: the stream, and the keys its frames are tagged with (plain on the
/// node's Unix socket). Every frame after the handshake goes through here, so none can go out untagged.
pub struct Conn<S> {
    /// The connection.
    pub stream: S,
    /// Its frame keys.
    pub seals: Seals,
}

impl<S: AsyncRead + Unpin> Conn<S> {
    /// Reads the next frame; `Ok(None)` at a clean end of stream.
    pub async fn read_frame(&mut self) -> io::Result<Option<Frame>> {
        read_sealed(&mut self.stream, &mut self.seals.recv).await
    }
}

impl<S: AsyncWrite + Unpin> Conn<S> {
    /// Writes one frame.
    pub async fn write_frame(&mut self, frame: &Frame) -> io::Result<()> {
        write_sealed(&mut self.stream, &mut self.seals.send, frame).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_length_over_the_limit_is_refused_before_reading_the_body() {
        let mut wire = ((MAX_FRAME + 1) as u32).to_be_bytes().to_vec();
        wire.push(4);
        let mut r = &wire[..];
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let e = rt.block_on(read_frame(&mut r)).unwrap_err();
        assert!(e.to_string().contains("more than the limit"), "{e}");
    }
}
