// Small bridges between C++ and Objective-C used by every file of the Metal
// backend. Objective-C++ with ARC only.
#pragma once

#import <Foundation/Foundation.h>

#include <exception>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

// The backend needs macOS 14 (MSL 3.1, bfloat, MTLArchitecture). Everything
// it declares carries this mark; make_metal_backend() checks the OS once at run
// time, so builds for older deployment targets stay clean and correct.
#define MFA_METAL_AVAILABILITY API_AVAILABLE(macos(14.0))

namespace mfa::metal {

// nil when `text` is not valid UTF-8; callers turn that into an error naming the argument.
inline NSString* to_ns_string(const std::string& text) {
  return [[NSString alloc] initWithBytes:text.data() length:text.size() encoding:NSUTF8StringEncoding];
}

inline std::string to_std_string(NSString* text) {
  const char* utf8 = text.UTF8String;
  return utf8 ? std::string(utf8) : std::string();
}

// An NSError as one readable text: its description, the reason the system
// gives, and the failure of what it wraps.
inline std::string describe(NSError* error) {
  if (!error) return "no error information";
  std::string text = to_std_string(error.localizedDescription);
  if (NSString* reason = error.localizedFailureReason) text += " (" + to_std_string(reason) + ")";
  if (NSError* underlying = error.userInfo[NSUnderlyingErrorKey]) text += ": " + describe(underlying);
  return text;
}

// Runs `body` inside an autorelease pool and returns its result. A C++
// exception that leaves an @autoreleasepool block skips draining it, so the
// exception is caught inside and rethrown once the pool is gone.
template <typename Body>
auto with_autorelease_pool(Body&& body) -> decltype(body()) {
  using Result = decltype(body());
  std::exception_ptr failure;
  if constexpr (std::is_void_v<Result>) {
    @autoreleasepool {
      try {
        body();
      } catch (...) {
        failure = std::current_exception();
      }
    }
    if (failure) std::rethrow_exception(failure);
  } else {
    std::optional<Result> result;
    @autoreleasepool {
      try {
        result.emplace(body());
      } catch (...) {
        failure = std::current_exception();
      }
    }
    if (failure) std::rethrow_exception(failure);
    return std::move(*result);
  }
}

}  // namespace mfa::metal
