// The hand-written parsing behind the compiler probe: which file names on
// PATH are compilers, and the major version in a `--version` line.
#include <gtest/gtest.h>

#include <string>

#include "compiler_names.hpp"

namespace {

using mfa::cpu::CompilerFamily;
using mfa::cpu::first_major_version;
using mfa::cpu::parse_compiler_name;

TEST(CompilerNames, AcceptsPlainAndVersionedGccAndClang) {
  auto gcc = parse_compiler_name("g++");
  ASSERT_TRUE(gcc);
  EXPECT_EQ(gcc->family, CompilerFamily::gcc);
  EXPECT_FALSE(gcc->version);

  auto gcc13 = parse_compiler_name("g++-13");
  ASSERT_TRUE(gcc13);
  EXPECT_EQ(gcc13->family, CompilerFamily::gcc);
  EXPECT_EQ(gcc13->version, 13);

  auto clang = parse_compiler_name("clang++");
  ASSERT_TRUE(clang);
  EXPECT_EQ(clang->family, CompilerFamily::clang);
  EXPECT_FALSE(clang->version);

  auto clang19 = parse_compiler_name("clang++-19");
  ASSERT_TRUE(clang19);
  EXPECT_EQ(clang19->family, CompilerFamily::clang);
  EXPECT_EQ(clang19->version, 19);
}

TEST(CompilerNames, RejectsEverythingElse) {
  for (const char* name : {"", "g+", "gcc", "c++", "clang", "clang-19", "g++-", "g++-13.2", "g++13", "g++-x",
                           "g++-13a", "x86_64-linux-gnu-g++", "g++-12-wrapper", "clang++-", "clang++19",
                           "g++-1234567"}) {
    EXPECT_FALSE(parse_compiler_name(name)) << name;
  }
}

TEST(CompilerVersions, FindsTheFirstMajorDotMinor) {
  EXPECT_EQ(first_major_version(" 12.2.0"), 12);  // what follows g++'s parentheses
  EXPECT_EQ(first_major_version("clang version 19.1.7 (++20250114103320+cd708029e0b2-1~exp1~20250114103432.75)"),
            19);
  EXPECT_EQ(first_major_version("Apple clang version 15.0.0 (clang-1500.3.9.4)"), 15);
  EXPECT_EQ(first_major_version("release 8 then 9.4"), 9);  // a lone number is not a version
  EXPECT_EQ(first_major_version("v7."), 0);
  EXPECT_EQ(first_major_version("1."), 0);
  EXPECT_EQ(first_major_version(".5 and 3.x"), 0);
  EXPECT_EQ(first_major_version(""), 0);
  EXPECT_EQ(first_major_version("no digits at all"), 0);
  EXPECT_EQ(first_major_version("123456789012.3 then 4.5"), 4);  // too long for a version (and for int)
  EXPECT_EQ(first_major_version("gcc 2.95"), 2);
}

}  // namespace
