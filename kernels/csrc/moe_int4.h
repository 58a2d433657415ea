// The 4-bit experts of a mixture-of-experts block in one call (moe_int4_cpu.cpp), bound by int4_cpu.cpp's module.
#pragma once

#include <torch/extension.h>

#include "int4_bf16_avx512.h"  // QUANTKIT_INT4_BF16 where the compiler targets AVX-512 BF16

#if defined(QUANTKIT_INT4_BF16)
// x bf16 [T, H]; chosen int64 [T, k] and weights fp32 [T, k] (the router's top k); w1 uint8 [E, ceil(2I/16), H, 8]
// with s1 [E, ceil(2I/16), H/gs1, 2, 16] (each expert's gate|up, Int4Blocked); w2 uint8 [E, ceil(H/16), I, 8] with
// s2 [E, ceil(H/16), I/gs2, 2, 16] (down). Returns bf16 [T, H]: each token's weighted sum of its experts' outputs.
torch::Tensor int4_moe_bf16(torch::Tensor x, torch::Tensor chosen, torch::Tensor weights, torch::Tensor w1,
                            torch::Tensor s1, int64_t gs1, torch::Tensor w2, torch::Tensor s2, int64_t gs2);
#endif

// The same in fp32 on the AVX2 kernel (every level): x fp32 [T, H] -> fp32 [T, H].
torch::Tensor int4_moe_f32(torch::Tensor x, torch::Tensor chosen, torch::Tensor weights, torch::Tensor w1,
                           torch::Tensor s1, int64_t gs1, torch::Tensor w2, torch::Tensor s2, int64_t gs2);
