//! The wire protocol (its frames are `tierstore_core::cluster::wire`) over tokio's async streams.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

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
    let mut out = Vec::new();
    encode(frame, &mut out);
    w.write_all(&out).await?;
    w.flush().await
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
