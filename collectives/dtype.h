// Element types and reduction operators of the collectives, and the reduction kernels.
//
//   reduce(dst, src, n, DataType::kF32, ReduceOp::kSum);   // dst[i] = dst[i] + src[i]
//
// Kernels are plain loops the compiler vectorizes (-O3 -march=native; f16 goes through F16C,
// bf16 through integer shifts). f16 and bf16 are combined in f32 and rounded back to the nearest
// even, which is the correctly rounded result for sum/prod/min/max (f32 has more than 2p+2 bits
// of precision for both). kAvg reduces as kSum; finish_avg() divides by the group size afterwards.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace trn {

enum class DataType : uint8_t { kF32, kF64, kF16, kBF16, kI32, kI64, kU8 };
enum class ReduceOp : uint8_t { kSum, kProd, kMin, kMax, kAvg };

inline constexpr DataType kAllDataTypes[] = {DataType::kF32,  DataType::kF64, DataType::kF16,
                                             DataType::kBF16, DataType::kI32, DataType::kI64,
                                             DataType::kU8};
inline constexpr ReduceOp kAllReduceOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin,
                                             ReduceOp::kMax, ReduceOp::kAvg};

size_t size_of(DataType t);
const char* to_string(DataType t);
const char* to_string(ReduceOp op);
// Parse "f32", "bf16", ... / "sum", "avg", ...; a bad name is a usage error listing the choices.
DataType parse_data_type(std::string_view name);
ReduceOp parse_reduce_op(std::string_view name);

// dst[i] = dst[i] op src[i] for i < count (kAvg: sum).
void reduce(void* dst, const void* src, size_t count, DataType t, ReduceOp op);
// dst[i] = a[i] op b[i]: the same rounding and operand order as reduce(a, b) followed by a copy,
// in one pass. dst may be a; otherwise dst must not overlap a or b.
void reduce(void* dst, const void* a, const void* b, size_t count, DataType t, ReduceOp op);
// Divides each element by divisor (integers: truncating division), for kAvg.
void finish_avg(void* buf, size_t count, DataType t, int divisor);

// Scalar conversions, round-to-nearest-even (NaN stays NaN).
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
float bf16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);

}  // namespace trn
