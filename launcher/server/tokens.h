// Per-job bearer tokens. A job's token is derived, not stored:
//
//   token = hex(HMAC-SHA256(key = the coordinator's admin token,
//                           message = "trn job token v1" NUL job_id NUL nonce))
//
// where the nonce is 32 random bytes (hex) drawn when the job is created and saved with the job
// (--state-dir, etcd). Why neither the token nor a hash of it is saved: a hash would let a
// restarted coordinator or a new leader check a token, but not hand it to a node that joins
// after the failover (every node of a job gets the same token); the token itself would make
// every copy of the state (a backup of the state dir, an etcd snapshot) a key to every job.
// A derived token is recomputed by any replica that holds the admin token, and the saved state
// alone yields none. The price: a coordinator restarted with another admin token derives other
// tokens, so the workers of jobs that were running are refused, and those jobs fail.
#pragma once

#include <string>

namespace trn::control {

// n bytes from getrandom(2), as 2n lowercase hex digits.
std::string random_hex(size_t n);

// The job's token (64 hex digits) from the admin token, the job id and its nonce.
std::string derive_job_token(const std::string& admin_token, const std::string& job_id,
                             const std::string& nonce);

// SHA-256 of s (32 raw bytes): the key under which a token is looked up, so a lookup's timing
// says nothing about the token's bytes.
std::string token_digest(const std::string& token);

}  // namespace trn::control
