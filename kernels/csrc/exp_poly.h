// The constants of the vector exponentials (vec512::exp16, vec2::exp8): e^x = 2^n e^r with n = round(x log2 e) and
// r = x - n ln2, ln2 split in two (kLn2Hi has few enough bits that n * kLn2Hi is exact in fp32, so r is too), and e^r
// by its degree-7 Taylor polynomial on |r| <= ln2 / 2 (truncation under 1e-8 relative), highest power first for
// Horner's rule.
#pragma once

namespace exppoly {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2Hi = 0.693145751953125f;
constexpr float kLn2Lo = 1.4286068203094173e-06f;
constexpr int kTerms = 8;
constexpr float kTaylor[kTerms] = {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};

}  // namespace exppoly
