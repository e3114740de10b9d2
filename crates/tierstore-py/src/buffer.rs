//! The buffer protocol under the stable ABI of CPython 3.10.
//!
//! `tierstore._core` is built with pyo3's `abi3-py310` (one `cp310-abi3` wheel for every CPython from 3.10
//! on). CPython added `Py_buffer`, `PyObject_GetBuffer`, `PyBuffer_Release` and the `bf_getbuffer` type
//! slot to the limited API only in 3.11, so pyo3 offers neither `pyo3::buffer` nor `__getbuffer__` under
//! `abi3-py310`. They are declared here instead: the struct and the two functions have been the same since
//! CPython 3.3 and every libpython exports them (3.11 put them in the stable ABI as they were), and
//! `PyType_FromSpec` has taken the buffer slots since 3.9. On 3.11 and later this is the stable ABI itself.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::mem::MaybeUninit;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::PyType;

/// CPython's `Py_buffer` (Include/pybuffer.h, unchanged since 3.3).
#[repr(C)]
struct PyBufferView {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

const PYBUF_FORMAT: c_int = 0x0004;
const PYBUF_ND: c_int = 0x0008;
const PYBUF_STRIDES: c_int = 0x0010 | PYBUF_ND;
const PYBUF_INDIRECT: c_int = 0x0100 | PYBUF_STRIDES;
const PYBUF_FULL_RO: c_int = PYBUF_INDIRECT | PYBUF_FORMAT;

/// The type slots of `PyBufferProcs` (Include/typeslots.h).
const PY_BF_GETBUFFER: c_int = 1;
const PY_BF_RELEASEBUFFER: c_int = 2;

extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut PyBufferView, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut PyBufferView);
    fn PyBuffer_IsContiguous(view: *const PyBufferView, order: c_char) -> c_int;
}

/// A buffer of bytes exported by a Python object (a `bytes`, `bytearray`, `memoryview`, uint8 numpy
/// array), released when dropped: what `pyo3::buffer::PyBuffer::<u8>` is outside the limited API.
pub(crate) struct ByteBuffer(Box<PyBufferView>);

// SAFETY: the view is only a description of memory the exporter keeps valid until the release, which
// takes the GIL (as pyo3's `PyBuffer` is Send and Sync).
unsafe impl Send for ByteBuffer {}
unsafe impl Sync for ByteBuffer {}

impl ByteBuffer {
    /// Exports `obj`'s buffer, as `PyBuffer::<u8>::get` does: any buffer whose items are single bytes.
    pub(crate) fn get(obj: &Bound<'_, PyAny>) -> PyResult<ByteBuffer> {
        let mut view = Box::new(MaybeUninit::<PyBufferView>::uninit());
        // SAFETY: `view` is room for a Py_buffer, which PyObject_GetBuffer fills when it returns 0.
        if unsafe { PyObject_GetBuffer(obj.as_ptr(), view.as_mut_ptr(), PYBUF_FULL_RO) } == -1 {
            return Err(PyErr::fetch(obj.py()));
        }
        // SAFETY: filled by PyObject_GetBuffer; from here on Drop releases it, whatever the checks say.
        let buffer = ByteBuffer(unsafe { Box::from_raw(Box::into_raw(view).cast::<PyBufferView>()) });
        let v = &*buffer.0;
        if v.shape.is_null() {
            Err(PyBufferError::new_err("shape is null"))
        } else if v.strides.is_null() {
            Err(PyBufferError::new_err("strides is null"))
        } else if v.itemsize != 1 || !byte_format(v.format) {
            Err(PyBufferError::new_err("buffer contents are not compatible with u8"))
        } else {
            Ok(buffer)
        }
    }

    pub(crate) fn readonly(&self) -> bool {
        self.0.readonly != 0
    }

    pub(crate) fn is_c_contiguous(&self) -> bool {
        // SAFETY: an exported view.
        unsafe { PyBuffer_IsContiguous(&*self.0, b'C' as c_char) != 0 }
    }

    pub(crate) fn buf_ptr(&self) -> *mut c_void {
        self.0.buf
    }

    pub(crate) fn len_bytes(&self) -> usize {
        self.0.len as usize
    }
}

impl Drop for ByteBuffer {
    fn drop(&mut self) {
        // SAFETY: exported by PyObject_GetBuffer and released once, with the GIL.
        Python::with_gil(|_| unsafe { PyBuffer_Release(&mut *self.0) });
    }
}

/// A struct module format of single bytes: `B` or `c`, with or without a byte order (`@`, `=`, `<`, `>`,
/// `!`); none means `B`.
fn byte_format(format: *const c_char) -> bool {
    if format.is_null() {
        return true;
    }
    // SAFETY: a NUL-terminated format string of an exported view.
    let f = unsafe { CStr::from_ptr(format) }.to_bytes();
    matches!(f, [b'B' | b'c'] | [b'@' | b'=' | b'<' | b'>' | b'!', b'B' | b'c'])
}

/// The object behind `tierstore._core.PackMap`: a mapping of a pack that exports itself as writable bytes.
#[repr(C)]
struct PackMapObject {
    ob_base: ffi::PyObject,
    map: *mut memmap2::MmapMut,
}

static PACK_MAP_TYPE: GILOnceCell<Py<PyType>> = GILOnceCell::new();

/// `PackMap`, a type of our own through `PyType_FromSpec` (its buffer slot is what pyo3 cannot declare
/// under `abi3-py310`): final, not constructible from Python, `len()` its size in bytes.
pub(crate) fn pack_map_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    PACK_MAP_TYPE
        .get_or_try_init(py, || {
            let mut slots = [
                ffi::PyType_Slot { slot: PY_BF_GETBUFFER, pfunc: pack_map_getbuffer as *mut c_void },
                ffi::PyType_Slot { slot: PY_BF_RELEASEBUFFER, pfunc: pack_map_releasebuffer as *mut c_void },
                ffi::PyType_Slot { slot: ffi::Py_mp_length, pfunc: pack_map_len as *mut c_void },
                ffi::PyType_Slot { slot: ffi::Py_tp_dealloc, pfunc: pack_map_dealloc as *mut c_void },
                ffi::PyType_Slot {
                    slot: ffi::Py_tp_doc,
                    pfunc: c"A pack mapped copy-on-write, its requested tensors checked: writable bytes whose \
                             writes copy the page and never reach the file."
                        .as_ptr() as *mut c_void,
                },
                ffi::PyType_Slot { slot: 0, pfunc: std::ptr::null_mut() },
            ];
            let mut spec = ffi::PyType_Spec {
                name: c"tierstore._core.PackMap".as_ptr(),
                basicsize: std::mem::size_of::<PackMapObject>() as c_int,
                itemsize: 0,
                flags: (ffi::Py_TPFLAGS_DEFAULT
                    | ffi::Py_TPFLAGS_IMMUTABLETYPE
                    | ffi::Py_TPFLAGS_DISALLOW_INSTANTIATION) as _,
                slots: slots.as_mut_ptr(),
            };
            // SAFETY: a valid spec; CPython copies what it needs from it (the name and doc are static).
            let ty = unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyType_FromSpec(&mut spec))? };
            Ok(ty.downcast_into::<PyType>()?.unbind())
        })
        .map(|t| t.bind(py))
}

/// A new `PackMap` owning `map`.
pub(crate) fn new_pack_map(py: Python<'_>, map: memmap2::MmapMut) -> PyResult<PyObject> {
    let ty = pack_map_type(py)?;
    // SAFETY: tp_alloc of our type gives a zeroed object of its basicsize, holding a reference to the type.
    unsafe {
        let alloc: ffi::allocfunc = std::mem::transmute(ffi::PyType_GetSlot(ty.as_ptr().cast(), ffi::Py_tp_alloc));
        let obj = alloc(ty.as_ptr().cast(), 0);
        if obj.is_null() {
            return Err(PyErr::fetch(py));
        }
        (*obj.cast::<PackMapObject>()).map = Box::into_raw(Box::new(map));
        Ok(PyObject::from_owned_ptr(py, obj))
    }
}

unsafe fn map_of<'a>(obj: *mut ffi::PyObject) -> &'a memmap2::MmapMut {
    &*(*obj.cast::<PackMapObject>()).map
}

unsafe extern "C" fn pack_map_len(obj: *mut ffi::PyObject) -> ffi::Py_ssize_t {
    map_of(obj).len() as ffi::Py_ssize_t
}

unsafe extern "C" fn pack_map_getbuffer(obj: *mut ffi::PyObject, view: *mut PyBufferView, flags: c_int) -> c_int {
    if view.is_null() {
        Python::with_gil(|py| PyBufferError::new_err("no buffer view to fill").restore(py));
        return -1;
    }
    let map = map_of(obj);
    // The mapping stays alive as long as `obj` (a reference to this object) is held, and a mapped pack
    // never moves. Writable: private pages, so a tensor changed in place (an optimizer step) copies its
    // pages.
    ffi::Py_INCREF(obj);
    (*view).obj = obj;
    (*view).buf = map.as_ptr() as *mut c_void;
    (*view).len = map.len() as ffi::Py_ssize_t;
    (*view).readonly = 0;
    (*view).itemsize = 1;
    (*view).format = if flags & PYBUF_FORMAT != 0 { c"B".as_ptr() as *mut c_char } else { std::ptr::null_mut() };
    (*view).ndim = 1;
    (*view).shape = if flags & PYBUF_ND != 0 { &mut (*view).len } else { std::ptr::null_mut() };
    (*view).strides = if flags & PYBUF_STRIDES == PYBUF_STRIDES { &mut (*view).itemsize } else { std::ptr::null_mut() };
    (*view).suboffsets = std::ptr::null_mut();
    (*view).internal = std::ptr::null_mut();
    0
}

unsafe extern "C" fn pack_map_releasebuffer(_obj: *mut ffi::PyObject, _view: *mut PyBufferView) {}

unsafe extern "C" fn pack_map_dealloc(obj: *mut ffi::PyObject) {
    let this = obj.cast::<PackMapObject>();
    if !(*this).map.is_null() {
        drop(Box::from_raw((*this).map));
        (*this).map = std::ptr::null_mut();
    }
    let ty = ffi::Py_TYPE(obj);
    let free: ffi::freefunc = std::mem::transmute(ffi::PyType_GetSlot(ty, ffi::Py_tp_free));
    free(obj.cast());
    // Instances of a heap type hold a reference to it.
    ffi::Py_DECREF(ty.cast());
}

/// A new `bytes` of at most `len` bytes, filled by `fill` without zeroing its memory first (as CPython's
/// own `read` makes its result): `fill` is handed the object's memory, not yet written, and returns how
/// many bytes it wrote from the start. When that is fewer than `len`, the bytes written are copied into
/// a `bytes` of their length (a file that ended early), so that no unwritten byte is ever seen.
pub(crate) fn bytes_filled<'py>(
    py: Python<'py>,
    len: usize,
    fill: impl FnOnce(&mut [MaybeUninit<u8>]) -> PyResult<usize>,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    // SAFETY: a NULL source asks CPython for a bytes object of `len` bytes whose contents are not yet
    // written; the new reference is owned by `object` (or the error set is taken).
    let object = unsafe {
        Bound::from_owned_ptr_or_err(py, ffi::PyBytes_FromStringAndSize(std::ptr::null(), len as ffi::Py_ssize_t))?
    };
    // SAFETY: the object is a bytes of `len` bytes that nothing else refers to yet; its memory is viewed as
    // not yet written, which any content is.
    let memory = unsafe {
        std::slice::from_raw_parts_mut(ffi::PyBytes_AsString(object.as_ptr()).cast::<MaybeUninit<u8>>(), len)
    };
    let written = fill(memory)?.min(len);
    if written < len {
        // SAFETY: the first `written` bytes were written by `fill`.
        let part = unsafe { std::slice::from_raw_parts(memory.as_ptr().cast::<u8>(), written) };
        return Ok(pyo3::types::PyBytes::new(py, part));
    }
    Ok(object.downcast_into::<pyo3::types::PyBytes>()?)
}
