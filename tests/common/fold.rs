//! Launch sizes past WebGPU's 65,535 workgroups per grid dimension, for tests of the kernels whose
//! launchers fold (1-D kernels: `grid_1d` in `src/backend/gpu/kernels.rs` spreads the workgroups
//! over x and y, and the shader recovers the flat index as `wid.y · nwg.x + wid.x`) or split (the
//! matmul family: several launches, each told its first tile) a larger grid. A kernel that reads
//! only `wid.x` passes every test whose grid fits in one dimension; the smallest shape past the
//! limit is the cheapest one that can catch it. Included with `#[path = "common/fold.rs"] mod fold;`.
#![allow(dead_code)]

/// Workgroups one grid dimension may hold (WebGPU's guaranteed minimum, the limit every launcher
/// folds or splits at).
pub const MAX_GROUPS: usize = 65_535;

/// Workgroups of a launch of `items` work items, `per_group` to a workgroup (before any folding).
pub fn groups(items: usize, per_group: usize) -> usize {
    items.div_ceil(per_group)
}

/// The fewest work items whose launch needs more than [`MAX_GROUPS`] workgroups of `per_group`
/// items each: the smallest launch that must fold.
pub fn smallest_folding(per_group: usize) -> usize {
    MAX_GROUPS * per_group + 1
}

/// The smallest size `n ≥ 1` whose launch needs more than [`MAX_GROUPS`] workgroups, for a
/// launcher whose workgroup count `groups(n)` grows with `n` (a formula [`smallest_folding`]
/// cannot invert, such as `⌈rows·n/256⌉`). Asserts the answer is past the limit and its
/// predecessor is not, so a fold case cannot silently shrink below the limit or grow past need.
pub fn smallest_past_limit(what: &str, groups: impl Fn(usize) -> usize) -> usize {
    let (mut lo, mut hi) = (1usize, 1usize);
    while groups(hi) <= MAX_GROUPS {
        lo = hi;
        hi *= 2;
    }
    // groups(lo) ≤ limit < groups(hi), or lo = hi = 1 when even 1 is past it
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if groups(mid) > MAX_GROUPS {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    assert!(
        groups(hi) > MAX_GROUPS && (hi == 1 || groups(hi - 1) <= MAX_GROUPS),
        "{what}: {hi} is not the smallest size past the grid limit"
    );
    hi
}

/// Asserts that a launch of `workgroups` workgroups cannot fit in one grid dimension, so that a
/// fold case cannot silently shrink below the limit it exists to cross.
pub fn assert_past_limit(what: &str, workgroups: usize) {
    assert!(
        workgroups > MAX_GROUPS,
        "{what}: {workgroups} workgroups fit in one grid dimension (limit {MAX_GROUPS}); the case \
         no longer exercises the folded grid"
    );
}

#[test]
fn smallest_folding_is_one_past_the_limit() {
    for per_group in [1, 64, 256] {
        let n = smallest_folding(per_group);
        assert_eq!(groups(n, per_group), MAX_GROUPS + 1);
        assert_eq!(groups(n - 1, per_group), MAX_GROUPS);
        assert_eq!(smallest_past_limit("linear", |i| groups(i, per_group)), n);
    }
}
