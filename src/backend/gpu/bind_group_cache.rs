//! The bind-group cache: a dispatch that binds the same buffers as an earlier one reuses that
//! dispatch's bind group instead of asking the driver for a new one.
//!
//! A bind group is what tells a kernel which buffers its `@binding(n)`s are. Creating one is
//! host work on every dispatch: wgpu validates each entry against the layout and the buffers'
//! usages, and the driver allocates and writes a descriptor set (Vulkan), an argument buffer
//! (Metal) or descriptor-heap entries (DX12), and frees it again once the work is done. A
//! training step records hundreds of dispatches, and once a run has settled (a few steps, up to
//! 14 for the models tested) the buffer pool (`buffer_pool.rs`) hands the step's tensors the
//! same buffers as the step before, so every dispatch binds a combination seen before: the
//! cache answers those from a hash map, and a steady step creates no bind group
//! (`GpuStats::bind_groups_created`, 0 like `buffers_created`).
//!
//! **Key.** The bind group layout (one per kernel), the size bound of the parameter slot
//! (binding 0; its offset is dynamic, so every slot of the arena shares one bind group), and
//! each storage binding's number, buffer and bound size. Buffers and layouts compare by identity
//! (wgpu's `Eq`/`Hash`); an entry holds clones of its buffers, so an identity cannot be reused
//! by a new buffer while the entry lives.
//!
//! **Memory.** An entry keeps its buffers alive. The pool never releases a buffer while training
//! (its free lists only grow), so this holds nothing the pool would free; [`BindGroupCache::clear`]
//! empties the cache when the pool is trimmed (`moegrad::gpu::release_free_memory`), and the
//! cache empties itself when it holds [`MAX_ENTRIES`] bind groups, so a run whose shapes keep
//! changing cannot grow it without bound.
//!
//! **Choice.** `MOEGRAD_BIND_GROUPS=create` (or `moegrad::gpu::set_bind_group_reuse(false)`)
//! turns reuse off, so that a GPU session can time what reuse saves; the default is `reuse`.

use super::encoder::StorageBinding;
use crate::{Error, Result};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// The most bind groups the cache holds before it empties itself.
pub(crate) const MAX_ENTRIES: usize = 16_384;

/// A cached bind group and the key it was made for.
struct Entry {
    layout: wgpu::BindGroupLayout,
    params_bound: u64,
    storage: Vec<(u32, wgpu::Buffer, u64)>,
    group: wgpu::BindGroup,
}

impl Entry {
    /// Whether this entry was made for the key.
    fn matches(
        &self,
        layout: &wgpu::BindGroupLayout,
        params_bound: u64,
        storage: &[StorageBinding],
    ) -> bool {
        self.layout == *layout
            && self.params_bound == params_bound
            && self.storage.len() == storage.len()
            && self
                .storage
                .iter()
                .zip(storage)
                .all(|((n, b, s), t)| *n == t.binding && *s == t.size && b == t.buffer.raw())
    }
}

/// Bind groups by the layout and buffers they bind (see the module docs).
pub(crate) struct BindGroupCache {
    /// entries by the hash of their key (a bucket holds the rare collisions)
    entries: HashMap<u64, Vec<Entry>>,
    /// entries held
    len: usize,
    /// whether bind groups are reused (false: every dispatch creates its own)
    reuse: bool,
}

impl BindGroupCache {
    /// An empty cache that reuses bind groups or not.
    pub(crate) fn new(reuse: bool) -> BindGroupCache {
        BindGroupCache {
            entries: HashMap::new(),
            len: 0,
            reuse,
        }
    }

    /// Whether bind groups are reused.
    pub(crate) fn reuse(&self) -> bool {
        self.reuse
    }

    /// Turns reuse on or off (off also empties the cache).
    pub(crate) fn set_reuse(&mut self, reuse: bool) {
        self.reuse = reuse;
        if !reuse {
            self.clear();
        }
    }

    /// Drops every cached bind group (and with them the cache's hold on their buffers).
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.len = 0;
    }

    /// Bind groups held now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The bind group binding `arena` (binding 0, `params_bound` bytes from offset 0, offset
    /// dynamic) and `storage` through `layout`: a cached one, or a new one (cached while reuse
    /// is on), after whose creation `created` is called (the caller counts it).
    pub(crate) fn get(
        &mut self,
        device: &wgpu::Device,
        layout: &wgpu::BindGroupLayout,
        arena: &wgpu::Buffer,
        params_bound: u64,
        storage: &[StorageBinding],
        created: impl FnOnce(),
    ) -> wgpu::BindGroup {
        let key = if self.reuse {
            let key = key_hash(layout, params_bound, storage);
            let hit = self.entries.get(&key).and_then(|bucket| {
                bucket
                    .iter()
                    .find(|e| e.matches(layout, params_bound, storage))
            });
            if let Some(e) = hit {
                return e.group.clone();
            }
            Some(key)
        } else {
            None
        };
        let mut entries = Vec::with_capacity(storage.len() + 1);
        entries.push(buffer_entry(0, arena, params_bound));
        for s in storage {
            entries.push(buffer_entry(s.binding, s.buffer.raw(), s.size));
        }
        let group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout,
            entries: &entries,
        });
        created();
        if let Some(key) = key {
            if self.len >= MAX_ENTRIES {
                self.clear();
            }
            self.entries.entry(key).or_default().push(Entry {
                layout: layout.clone(),
                params_bound,
                storage: storage
                    .iter()
                    .map(|s| (s.binding, s.buffer.raw().clone(), s.size))
                    .collect(),
                group: group.clone(),
            });
            self.len += 1;
        }
        group
    }
}

/// One buffer binding of `size` bytes from offset 0.
fn buffer_entry(binding: u32, buffer: &wgpu::Buffer, size: u64) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry {
        binding,
        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer,
            offset: 0,
            size: wgpu::BufferSize::new(size),
        }),
    }
}

/// The hash of a cache key.
fn key_hash(layout: &wgpu::BindGroupLayout, params_bound: u64, storage: &[StorageBinding]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    layout.hash(&mut h);
    params_bound.hash(&mut h);
    for s in storage {
        s.binding.hash(&mut h);
        s.buffer.raw().hash(&mut h);
        s.size.hash(&mut h);
    }
    h.finish()
}

/// Whether `MOEGRAD_BIND_GROUPS` asks for reuse: `reuse` (or unset) or `create`.
pub(crate) fn reuse_from_env() -> Result<bool> {
    reuse_from_setting(std::env::var("MOEGRAD_BIND_GROUPS").ok().as_deref())
}

/// Parses a setting of `MOEGRAD_BIND_GROUPS` (`None`: unset, reuse).
pub(crate) fn reuse_from_setting(setting: Option<&str>) -> Result<bool> {
    match setting.map(str::trim) {
        None | Some("reuse") => Ok(true),
        Some("create") => Ok(false),
        Some(other) => Err(Error::Invalid(format!(
            "MOEGRAD_BIND_GROUPS={other:?} is not reuse or create"
        ))),
    }
}
