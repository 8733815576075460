"""The tolerances parity results are judged by, each with the reason it is as large as it is
(fp32 on CPU; what a real bug would move instead)."""

# fp32 CPU. Gradients: TP splits each row-parallel GEMM into partial sums added by a
# reduce-scatter, so a gradient entry differs from HF's by rounding of sums of ~100-1000 terms of
# size <= |g|max: well below 1e-5 x max |g| (which is O(1) for these losses). Losses: the same
# rounding through a few steps of training; a real bug moves them by far more than 1e-5.
HF_GRAD_TOLERANCE = 1e-5  # max |grad diff| at step 1, relative to max |HF grad| (at least 1)
HF_LOSS_TOLERANCE = 1e-5


# tutel's kernels (``dhelix.moe.kernels``) write the same rows and weigh the copies in float32 as
# torch's do, so the first-step loss is the same; their backward sums each routing weight's
# gradient over the hidden size in tutel's own order, which moves the router's gradients (and what
# flows back from them) by rounding of a sum of ``hidden`` terms: held within 1e-6 x max |g|.
KERNELS_GRAD_TOLERANCE = 1e-6


# HF's MoE blocks are dropless: with a capacity factor that drops copies the model differs from
# HF's by design, so only SI = sequential (and the kernels' agreement) can hold then.
CAPACITY_NOTE = (
    "capacity mode: Hugging Face's model is dropless, so hf_close holds only when no copy is "
    "dropped (a capacity factor large enough for the busiest expert)"
)


# The intra schedule sums each weight gradient as two halves' sums (and each loss as two halves'),
# so it is not bitwise equal to sequential: its first-step gradients and every step's loss are held
# to sequential's within the HF tolerances above in fp32 (the same kind of rounding: one more
# split of a sum). In bf16 / fp16 the halves' partial sums are rounded to 8 / 11 bits of mantissa
# before they are added, and a few optimizer steps carry that on: the losses are held within
# INTRA_LOSS_TOLERANCE_LOW_PRECISION (a wrong half weighting moves them by ~the loss itself).
INTRA_LOSS_TOLERANCE_LOW_PRECISION = 2e-2


# Gradients accumulate over micro-batches in the same order as PP=1 (every chunk runs its
# backwards in micro-batch order), so without clipping (clip=0) the pipeline is bitwise equal.
# With clipping the global grad norm is a sum of squares that PP=p sums per stage (and ZeRO-1 with
# DP > 1 per optimizer partition) before the all-reduce, so the clip factor may differ from PP=1's
# in its last bit and Adam magnifies that.
PP_TOLERANCE = 1e-5


# An export reloaded by transformers / PEFT (fp32) against the trained engine's own probe loss on
# the same micro-batch. fp32: the sharded forward sums TP partial products in another order (~1e-6
# relative on a loss of ~7). bf16 / fp16: the engine's forward rounds every activation to 8 / 11
# bits of mantissa while the reloaded model computes in fp32 on the same weights (measured on the
# feature matrix's rows: under 1e-4 on 2 layers); a wrong tensor in the export (a shard in the
# wrong place, a factor missing) moves the loss by far more than 1e-2.
EXPORT_LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 1e-2}
