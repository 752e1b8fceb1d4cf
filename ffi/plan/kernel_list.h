// Every kernel the build instantiates, as X-macro lists: the CUDA launch units instantiate exactly
// these (ffi/cuda/kernels_*.cu), and the launch plan may name only these (tests/test_plan.py checks it).
#pragma once

#include "common/walk_config.h"

// MarkovWalkKernel<WalkTraits<NT, SPLIT, DIGITS, W2, THREADS, STAGED, FORM, PAIRS, EREGS, CERT>>:
// X(NT, SPLIT, DIGITS, W2, THREADS, STAGED, FORM, PAIRS, EREGS, CERT). The kernels of up to 16 columns
// come with and without staged base logits.
#define JAX_MARKOV_STAGED_PAIR(X, NT, SPLIT, DIGITS, W2, THREADS, FORM, PAIRS, EREGS, CERT)         \
  X(NT, SPLIT, DIGITS, W2, THREADS, false, FORM, PAIRS, EREGS, CERT)                                \
  X(NT, SPLIT, DIGITS, W2, THREADS, true, FORM, PAIRS, EREGS, CERT)

// The fp16 / bf16 wgmma and mma.sync kernels of one W2 format, for 8, 16, 32 and 64 columns: a
// request a column, or two (SPLIT: hi and lo parts).
#define JAX_MARKOV_COLUMN_KERNELS(X, W2, THREADS_UP_TO_16)                                          \
  JAX_MARKOV_STAGED_PAIR(X, 1, true, false, W2, THREADS_UP_TO_16, kAnyForm, false, false, false)    \
  JAX_MARKOV_STAGED_PAIR(X, 2, true, false, W2, THREADS_UP_TO_16, kAnyForm, false, false, false)    \
  X(4, true, false, W2, 256, false, kAnyForm, false, false, false)                                  \
  X(8, true, false, W2, 256, false, kAnyForm, false, false, false)                                  \
  JAX_MARKOV_STAGED_PAIR(X, 1, false, false, W2, THREADS_UP_TO_16, kAnyForm, false, false, false)   \
  JAX_MARKOV_STAGED_PAIR(X, 2, false, false, W2, THREADS_UP_TO_16, kAnyForm, false, false, false)   \
  X(4, false, false, W2, 256, false, kAnyForm, false, false, false)                                 \
  X(8, false, false, W2, 256, false, kAnyForm, false, false, false)

#define JAX_MARKOV_INT8_WALK_KERNELS(X)                                                             \
  /* 1-2 requests: e's three int8 digits, in every known launch form */                             \
  JAX_MARKOV_STAGED_PAIR(X, 1, false, true, kW2Int8, 512, kAnyForm, false, false, false)            \
  JAX_MARKOV_STAGED_PAIR(X, 1, false, true, kW2Int8, 512, kBF16LogitsForm, false, false, false)     \
  JAX_MARKOV_STAGED_PAIR(X, 1, false, true, kW2Int8, 512, kF32LogitsForm, false, false, false)      \
  JAX_MARKOV_STAGED_PAIR(X, 1, false, true, kW2Int8, 512, kPlainForm, false, false, false)          \
  /* 3-8 requests: e's digit pairs */                                                               \
  JAX_MARKOV_STAGED_PAIR(X, 1, true, false, kW2Int8, 512, kAnyForm, true, false, false)             \
  JAX_MARKOV_STAGED_PAIR(X, 2, true, false, kW2Int8, 512, kAnyForm, true, false, false)             \
  /* 9-16 greedy requests, tokens only or bf16 logits out: e's digit pairs as the A operand */     \
  /* (EREGS) */                                                                                     \
  JAX_MARKOV_STAGED_PAIR(X, 2, false, false, kW2Int8, 256, kPlainForm, false, true, false)          \
  JAX_MARKOV_STAGED_PAIR(X, 2, false, false, kW2Int8, 256, kBF16LogitsForm, false, true, false)     \
  JAX_MARKOV_COLUMN_KERNELS(X, kW2Int8, 512)

// A CertifiedMarkovHead (cuda/walk/certified.cuh): 1-2 requests in the digit kernel, tokens only or
// any other form; 3-8 on the digit pairs; 9-16 greedy requests, tokens only, in EREGS.
#define JAX_MARKOV_CERTIFIED_WALK_KERNELS(X)                                                        \
  JAX_MARKOV_STAGED_PAIR(X, 1, false, true, kW2Int8, 512, kPlainForm, false, false, true)           \
  JAX_MARKOV_STAGED_PAIR(X, 1, false, true, kW2Int8, 512, kAnyForm, false, false, true)             \
  JAX_MARKOV_STAGED_PAIR(X, 1, true, false, kW2Int8, 512, kAnyForm, true, false, true)              \
  JAX_MARKOV_STAGED_PAIR(X, 2, true, false, kW2Int8, 512, kAnyForm, true, false, true)              \
  JAX_MARKOV_STAGED_PAIR(X, 2, false, false, kW2Int8, 256, kPlainForm, false, true, true)

#define JAX_MARKOV_F16_WALK_KERNELS(X) JAX_MARKOV_COLUMN_KERNELS(X, kW2F16, 256)
#define JAX_MARKOV_BF16_WALK_KERNELS(X) JAX_MARKOV_COLUMN_KERNELS(X, kW2BF16, 256)

// MarkovWalkTransposedKernel<BASE, PACKED, WALK> (17-64 requests over int8 W2, 9-16 of a head with tiles):
// X(BASE, PACKED, WALK).
#define JAX_MARKOV_TRANSPOSED_WALKS(X, BASE)                                                        \
  X(BASE, true, kPlainWalk) X(BASE, true, kLogitsWalk) X(BASE, true, kSampledWalk)                  \
  X(BASE, false, kPlainWalk) X(BASE, false, kLogitsWalk) X(BASE, false, kSampledWalk)               \
  X(BASE, false, kRotatedSampledWalk)
// A CertifiedMarkovHead's 17-64 greedy requests from bf16 base logits, tokens only
// (cuda/transposed/certified.cuh).
#define JAX_MARKOV_TRANSPOSED_KERNELS(X)                                                            \
  JAX_MARKOV_TRANSPOSED_WALKS(X, kF32) JAX_MARKOV_TRANSPOSED_WALKS(X, kBF16) JAX_MARKOV_TRANSPOSED_WALKS(X, kF16) \
  X(kBF16, true, kCertifiedWalk) X(kBF16, false, kCertifiedWalk)
