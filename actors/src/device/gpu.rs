//! GPU discovery through the CUDA driver API, loaded at run time. The only place the
//! workspace touches CUDA.

use super::{DeviceProfile, DiscoveryError, GpuInfo, profile_from_attributes};
use cudarc::driver::sys::CUdevice_attribute as Attr;

pub(super) fn discover() -> Result<Vec<GpuInfo>, DiscoveryError> {
    // `CudaContext::new` panics when libcuda cannot be loaded: ask first.
    // SAFETY: only tries to dlopen libcuda and reports whether it succeeded; no CUDA call is
    // made and no state is shared with other code.
    #[allow(unsafe_code)]
    let present = unsafe { cudarc::driver::sys::is_culib_present() };
    if !present {
        return Err(DiscoveryError::NoDriver);
    }
    let n = cudarc::driver::CudaContext::device_count().map_err(DiscoveryError::Driver)?;
    let mut out = Vec::new();
    for ordinal in 0..n.max(0) as usize {
        let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(DiscoveryError::Driver)?;
        let attr = |a: Attr| ctx.attribute(a).map_err(DiscoveryError::Driver);
        let sms = attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let clock_khz = attr(Attr::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)? as u32;
        let mem_khz = attr(Attr::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)? as u32;
        let bus = attr(Attr::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)? as u32;
        let name = ctx.name().map_err(DiscoveryError::Driver)?;
        let memory_bytes = ctx.total_mem().map_err(DiscoveryError::Driver)? as u64;
        let major = attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32;
        let minor = attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32;
        let mut gpu = GpuInfo {
            ordinal,
            name,
            compute_capability: (major, minor),
            sms,
            memory_bytes,
            clock_mhz: clock_khz / 1000,
            memory_clock_mhz: mem_khz / 1000,
            bus_width_bits: bus,
            profile: DeviceProfile::default(),
        };
        gpu.profile = profile_from_attributes(&gpu);
        out.push(gpu);
    }
    Ok(out)
}
