//! [`BufferOps`]: the base of every family trait — a device's buffer type and the copies between
//! the host and the device.

use crate::Result;
use crate::backend::HostData;

/// A device's buffers: the buffer type every family trait computes on, and the copies between the
/// host and the device. Buffers are flat and contiguous; each knows its dtype and length.
pub(crate) trait BufferOps {
    /// A device buffer.
    type Buffer: Clone;
    /// Copies host data to the device.
    fn upload(&self, data: &HostData) -> Result<Self::Buffer>;
    /// Copies a buffer back to the host (on the GPU this waits for pending work).
    fn download(&self, x: &Self::Buffer) -> Result<HostData>;
}
