//! Typed errors: every status the C++ layer can return, with the context of the call.

use std::fmt;

/// What went wrong, one variant per C++ `moe_routing::Status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Success = 0,
    InvalidConfig = 1,
    InvalidShape = 2,
    NullPointer = 3,
    Misaligned = 4,
    BufferTooSmall = 5,
    ForeignPointer = 6,
    Cuda = 7,
    Unsupported = 8,
}

impl Status {
    pub(crate) fn from_code(code: i32) -> Self {
        match code {
            0 => Status::Success,
            1 => Status::InvalidConfig,
            2 => Status::InvalidShape,
            3 => Status::NullPointer,
            4 => Status::Misaligned,
            5 => Status::BufferTooSmall,
            6 => Status::ForeignPointer,
            8 => Status::Unsupported,
            _ => Status::Cuda,
        }
    }

    /// A CUDA error's message ends with the runtime's name and description of it.
    pub(crate) fn into_result(self, context: impl FnOnce() -> String) -> Result<(), Error> {
        match self {
            Status::Success => Ok(()),
            Status::Cuda => Err(Error {
                kind: Status::Cuda,
                message: format!("{} ({})", context(), crate::bridge::ffi::last_cuda_error()),
            }),
            kind => Err(Error {
                kind,
                message: context(),
            }),
        }
    }

    /// The C++ layer's description of this status (one source for every language).
    fn describe(self) -> &'static str {
        crate::bridge::ffi::status_string(self as i32)
    }
}

/// An error from the router: its kind and what the call was doing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub kind: Status,
    pub message: String,
}

impl Error {
    pub(crate) fn new(kind: Status, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
    pub(crate) fn invalid_config(message: impl Into<String>) -> Self {
        Self::new(Status::InvalidConfig, message)
    }
    pub(crate) fn invalid_shape(message: impl Into<String>) -> Self {
        Self::new(Status::InvalidShape, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.describe(), self.message)
    }
}

impl std::error::Error for Error {}

impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Error::new(Status::Cuda, format!("{e:?}"))
    }
}
