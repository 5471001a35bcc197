// Content digests of packed bytes: how the ranks of one host prove they hold the same weights before
// they share one host copy.
//
// A 64-bit hash, not a cryptographic one: it tells different checkpoints, seeds, shards or one edited
// element apart, it is not meant to resist an adversary. The bytes are cut into fixed chunks that are
// hashed in parallel and then folded in order, so the value depends only on the bytes, never on the
// number of threads. Every step is a bijection of the running state for fixed input, so two inputs of
// the same length that differ in a single 8-byte word always hash differently.
//
// copy_and_digest() fills the host copy and hashes each chunk while it is still in cache: the owner
// of a shared copy gets the digest of what it packed at no extra pass over memory.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fastoffload {

// Digest of `nbytes` bytes at `data`.
uint64_t digest_bytes(const void* data, size_t nbytes);

// Copies `nbytes` from `src` to `dst` (non-overlapping) and returns digest_bytes(dst, nbytes).
uint64_t copy_and_digest(void* dst, const void* src, size_t nbytes);

}  // namespace fastoffload
