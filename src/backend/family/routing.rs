//! [`RoutingOps`]: the Mixture-of-Experts routing primitives: the fused top-k gate and its
//! backward, the dispatch plan that sorts assignments by expert under a capacity, and the
//! weighted combine of expert outputs into tokens and its backward, the routing statistics
//! that the training loop's diagnostics sum over a window of steps, and the Switch balance loss.

use crate::Result;
use crate::backend::{BufferOps, PlanBuffers, RoutingStatsDims};

/// MoE routing primitives: the top-k gate, its backward, the dispatch plan and the combine.
pub(crate) trait RoutingOps: BufferOps {
    /// The weighted combine `y [len, d]`, `y[t] = Σ_{r : idx[r] = t} w[r]·rows[r]` for
    /// `rows [A, d]`, `w [A]` of the same float dtype and `idx [A]` I32 (`sizes` is `(d, len)`):
    /// each product rounded to the dtype, the sum in increasing `r` (f32 sums for f16), as the
    /// composition `rows·w` then `index_scatter` rounds. The CPU rejects an index outside
    /// `0..len`; the GPU cannot check without a read-back, and ignores it. `slots`, when given
    /// as `(s, k)` with `s: [len·k]` I32, lists each output's rows (`s[t·k..t·k+k]` are the `k`
    /// rows with `idx = t`, in any order): the same result, computed on the GPU without
    /// sorting `idx`; the CPU checks the promise and rejects slots that break it. Without `w`,
    /// every weight is 1 and nothing is multiplied: `index_scatter`'s sum, to the bit.
    /// `slot_order`, given with `slots` and `w`, says `w` is per slot rather than per row: the
    /// weight of row `s[i]` is `w[i]`, and `slot_order` (I32 `[A]`) is the slots' inverse, each
    /// row's slot (the CPU checks it; the GPU reads the weights through the slots).
    /// `addend`, given with `rows` (the output's dtype, `[len, d]`), is added to the output:
    /// `addend[t] + y[t]` with `y` rounded to the dtype first, the bits of adding it afterwards
    /// (an MoE block's residual, added by the combine's own kernel on the GPU where the slots
    /// are given).
    fn weighted_scatter(
        &self,
        rows: (&Self::Buffer, Option<&Self::Buffer>),
        w: Option<&Self::Buffer>,
        idx: &Self::Buffer,
        sizes: (usize, usize),
        slots: Option<(&Self::Buffer, usize)>,
        slot_order: Option<&Self::Buffer>,
    ) -> Result<Self::Buffer>;
    /// The gradients `(d_rows [A, d], d_w [A])` of [`RoutingOps::weighted_scatter`] for
    /// `dy [len, d]`: `d_rows[r] = w[r]·dy[idx[r]]`, `d_w[r] = ⟨dy[idx[r]], rows[r]⟩`; with
    /// `slot_order` (weights per slot), `w[order[r]]` in the first and `d_w[order[r]]` written.
    fn weighted_scatter_backward(
        &self,
        rows: &Self::Buffer,
        w: &Self::Buffer,
        idx: &Self::Buffer,
        dy: &Self::Buffer,
        sizes: (usize, usize),
        slot_order: Option<&Self::Buffer>,
    ) -> Result<(Self::Buffer, Self::Buffer)>;
    /// The fused gate of a top-k router, one row of `[rows, n]` at a time: `probs = softmax(logits)`;
    /// `idx` (I32 `[rows, k]`) the `k` largest `scores` (the logits when `scores` is `None`) in
    /// descending order, ties by the lowest index, NaN as the smallest value (as
    /// [`ReduceOps::argsort`](crate::backend::ReduceOps::argsort)); `weights` (`[rows, k]`) the softmax over the `k` selected scores
    /// (`renormalise`, Shazeer's gate) or the probabilities at `idx` (unnormalised). Returns
    /// `(probs, idx, weights)`. Sizes ≥ 1, `k ≤ n`.
    fn topk_gate(
        &self,
        logits: &Self::Buffer,
        scores: Option<&Self::Buffer>,
        rows: usize,
        n: usize,
        k: usize,
        renormalise: bool,
    ) -> Result<(Self::Buffer, Self::Buffer, Self::Buffer)>;
    /// The gradient of [`RoutingOps::topk_gate`]'s `weights` with respect to what they were computed
    /// from, for the upstream gradient `d_weights` (`[rows, k]`); output `[rows, n]`. Renormalised
    /// (`probs` is `None`): `∂scores[idx_j] = w_j (a_j − Σ_i w_i a_i)`, zero elsewhere.
    /// Unnormalised (`probs` given, `[rows, n]`): `∂logits_c = p_c (a'_c − Σ_j a_j w_j)`, with
    /// `a'_c = a_j` where `c = idx_j` and 0 elsewhere. `sizes` is `(rows, n, k)`. With `pending`
    /// (`[rows, n]`, the gradient the logits or scores already have) the output is
    /// `pending + ∂`, to the bit of that add: the tape's folding rule, one launch instead of two.
    fn topk_gate_backward(
        &self,
        weights: &Self::Buffer,
        idx: &Self::Buffer,
        d_weights: &Self::Buffer,
        probs_pending: (Option<&Self::Buffer>, Option<&Self::Buffer>),
        sizes: (usize, usize, usize),
    ) -> Result<Self::Buffer>;
    /// The MoE dispatch plan of `A` assignments over `experts` experts (see `moe::dispatch`):
    /// assignment `i` goes to expert `expert[i]` (I32) when `valid[i] ≠ 0` and the expert is in
    /// `0..experts`, else to a trash group after the last expert. The rows are the assignments
    /// sorted by (expert, `rank` ascending, `weight` descending with NaN last, `i`), and a row is
    /// kept while its position within its expert is below `capacity`. Without a capacity
    /// (`None`) every row is kept and the rows are sorted by (expert, `i`): a stable counting
    /// sort, since no priority decides anything.
    /// `token` (I32) and the float `(weight, rank, valid)` are `[A]`.
    fn dispatch_plan(
        &self,
        token: &Self::Buffer,
        expert: &Self::Buffer,
        order_keys: (&Self::Buffer, &Self::Buffer, &Self::Buffer),
        experts: usize,
        capacity: Option<usize>,
    ) -> Result<PlanBuffers<Self::Buffer>>;
    /// One step's routing statistics added into a window's sums `acc` (zeros when `None`), all
    /// f32: `probs [rows, cols]`'s column sums, `routed` and `kept` (`[experts]`), the sum of the
    /// tokens' entropies `−Σ p·ln(p + 1e-12)`, the logits' square sum and their largest
    /// magnitude (NaN wins), in one launch on the GPU. Returns the new sums,
    /// `[cols + 2·experts + 3]` in that order (`shaders/router_sums.wgsl`).
    fn routing_stats(
        &self,
        acc: Option<&Self::Buffer>,
        probs_logits: (&Self::Buffer, &Self::Buffer),
        routed_kept: (&Self::Buffer, &Self::Buffer),
        dims: RoutingStatsDims,
    ) -> Result<Self::Buffer>;
    /// The Switch balance loss' forward for the router distribution `probs [rows, cols]` and the
    /// constant assignment counts `counts [cols]` (one float dtype): `coef[e] = scale·counts[e] /
    /// max(Σ counts, 1)` and `loss = Σ_e coef[e]·Σ_t probs[t, e]`, in one launch on the GPU.
    /// Returns `(loss [1], coef [cols])`; `coef` is the loss' gradient with respect to each row
    /// of `probs`. Sizes ≥ 1.
    fn balance_loss(
        &self,
        probs: &Self::Buffer,
        counts: &Self::Buffer,
        sizes: (usize, usize),
        scale: f64,
    ) -> Result<(Self::Buffer, Self::Buffer)>;
}
