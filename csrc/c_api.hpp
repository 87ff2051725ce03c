// What the C API's translation units share: the plan handle, and the guard that
// turns an exception into a cosa_status and the thread's last error message.
#pragma once

#include <exception>
#include <new>
#include <stdexcept>
#include <string>

#include "cosa/cosa.h"
#include "remap.hpp"

struct cosa_remap_plan {
    cosa::Plan plan;
};

namespace cosa {

// Errors that are neither a bad argument nor a bug.
struct CudaError : std::runtime_error {
    using std::runtime_error::runtime_error;
};
struct Unsupported : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// cosa_last_error()'s message; inline, so one object per thread in libcosa.
inline std::string& last_error() {
    thread_local std::string message;
    return message;
}

// Runs `body`, translating what it throws into a status and last_error().
template <class Body>
cosa_status guarded(Body&& body) noexcept {
    try {
        body();
        last_error().clear();
        return COSA_OK;
    } catch (const std::invalid_argument& e) {
        last_error() = e.what();
        return COSA_ERROR_INVALID_ARGUMENT;
    } catch (const CudaError& e) {
        last_error() = e.what();
        return COSA_ERROR_CUDA;
    } catch (const Unsupported& e) {
        last_error() = e.what();
        return COSA_ERROR_UNSUPPORTED;
    } catch (const std::bad_alloc&) {
        last_error() = "out of memory";
    } catch (const std::exception& e) {
        last_error() = std::string("internal error: ") + e.what();
    } catch (...) {
        last_error() = "internal error: unknown exception";
    }
    return COSA_ERROR_INTERNAL;
}

inline void require(const void* pointer, const char* name) {
    if (pointer == nullptr) fail(name, " must not be NULL");
}

// Validates args and builds the host plan; throws std::invalid_argument.
Plan build_plan(const cosa_remap_args& args);

}  // namespace cosa
