// test_deadline.cpp: the deadline every GPU wait of the tests runs under (wait_for_gpu,
// test_util.h), checked on the CPU: the polling, the deadline's size, the failure line, and that
// a run whose deadline passes ends at once, failed, with the summary line and a non-zero exit;
// and that every test case's name prints in the header Catch writes when it fails.

#include "test_util.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>
#include <sys/wait.h>
#include <unistd.h>

using Catch::Matchers::Contains;

namespace {
// A GPU call as a test would make it (gpu_call asks the device which chapter runs; here it is
// given).
GpuCall call_of(const char* direction, int chapter, Kernel kernel, const AttentionShape& s) {
    return {direction, chapter == 1 ? "fp32" : "fp16", kernel, s, chapter};
}
}  // namespace

TEST_CASE("The deadline's poll returns as the GPU finishes, fails, or the time runs out",
          "[cpu][deadline]") {
    double clock = 0;  // seconds, advanced by each pause
    int polls = 0, pauses = 0;
    const auto now = [&] { return clock; };
    const auto pause = [&] { ++pauses, clock += 0.5; };
    SECTION("finished on the fourth poll") {
        const auto poll = [&] { return ++polls < 4 ? cudaErrorNotReady : cudaSuccess; };
        CHECK(poll_until(poll, now, pause, 10.0) == cudaSuccess);
        CHECK(polls == 4);
        CHECK(pauses == 3);
    }
    SECTION("an error (a kernel that faulted) is returned at once") {
        const auto poll = [&] { return ++polls < 2 ? cudaErrorNotReady : cudaErrorIllegalAddress; };
        CHECK(poll_until(poll, now, pause, 10.0) == cudaErrorIllegalAddress);
        CHECK(polls == 2);
    }
    SECTION("never finished: not ready once the deadline has passed, and not before") {
        const auto poll = [&] { return ++polls, cudaErrorNotReady; };
        CHECK(poll_until(poll, now, pause, 10.0) == cudaErrorNotReady);
        CHECK(clock >= 10.0);
        CHECK(clock < 10.5 + 1e-9);  // gave up at the first poll past the deadline
        CHECK(polls == 21);          // at 0, 0.5, ..., 10
    }
    SECTION("already done: one poll, no pause") {
        const auto poll = [&] { return ++polls, cudaSuccess; };
        CHECK(poll_until(poll, now, pause, 0.0) == cudaSuccess);
        CHECK(polls == 1);
        CHECK(pauses == 0);
    }
}

TEST_CASE("The deadline grows with the shape's work from 10 s, and the environment scales it",
          "[cpu][deadline]") {
    const AttentionShape tiny{1, 1, 1, 1, 16, false};
    const AttentionShape big{4097, 32, 128, 128, 128, false};  // the 2^31-element test's
    const Kernel pub = Kernel::public_call();
    CHECK(deadline_seconds(call_of("forward", 1, pub, tiny)) == Approx(10.0).epsilon(1e-6));
    // By hand: 4 * 4097 * 32 * 128^3 = 1.0999e12 flop at 1e11 flop/s: 11.0 s, + 10.
    CHECK(deadline_seconds(call_of("forward", 1, pub, big)) == Approx(20.999).epsilon(1e-3));
    // The backward's 10 flop per (row, key, column) for the forward's 4.
    CHECK(deadline_seconds(call_of("backward", 1, pub, big)) == Approx(37.498).epsilon(1e-3));
    CHECK(deadline_seconds(call_of("forward", 1, pub, big), 20.0) ==
          Approx(20 * 20.999).epsilon(1e-3));
    // Ten times what the slowest correct kernel takes, at least: chapter 1 on a T4 does over
    // 1e12 flop/s at this shape, so its 1.1e12 flop take about a second, and the deadline is 21.
    CHECK(deadline_seconds(call_of("forward", 1, pub, big)) >= 10 * 1.0999e12 / 1e12);

    const char* kept = std::getenv("FLASH_TEST_DEADLINE_SCALE");
    const std::string keep = kept ? kept : "";
    for (const auto& [text, scale] : {std::pair<const char*, double>{"20", 20.0}, {"0.5", 0.5},
                                      {"abc", 1.0}, {"-3", 1.0}, {"0", 1.0}, {"", 1.0}}) {
        CAPTURE(text);
        setenv("FLASH_TEST_DEADLINE_SCALE", text, 1);
        CHECK(deadline_scale_from_env() == scale);
    }
    unsetenv("FLASH_TEST_DEADLINE_SCALE");
    CHECK(deadline_scale_from_env() == 1.0);
    if (kept) setenv("FLASH_TEST_DEADLINE_SCALE", keep.c_str(), 1);
}

TEST_CASE("The deadline's failure line names the test case, the shape, the kernel and what likely "
          "waits forever", "[cpu][deadline]") {
    const AttentionShape s{2, 3, 200, 333, 128, true};
    const std::string hopper =
        deadline_message("A test", call_of("forward", 3, Kernel::chapter3(), s), 12.5);
    INFO(hopper);
    CHECK_THAT(hopper, Contains("\"A test\"") && Contains(describe(s)) &&
                           Contains("chapter 3's kernel") && Contains("12.5 s"));
    CHECK_THAT(hopper, Contains("mbarrier") && Contains("phase") && Contains("expected bytes") &&
                           Contains("arrival count") && Contains("stage") &&
                           Contains("tile counter"));
    // The public call on compute capability 9.0 runs chapter 3: the culprit follows the chapter.
    CHECK(likely_hang(call_of("forward", 3, Kernel::public_call(), s)) ==
          likely_hang(call_of("forward", 3, Kernel::chapter3(), s)));
    const std::string turns =
        deadline_message("B", call_of("backward", 2, Kernel::public_call(), s), 30);
    INFO(turns);
    CHECK_THAT(turns, Contains("backward") && Contains("turn") && Contains("dQ"));
    for (const GpuCall& call : {call_of("forward", 1, Kernel::public_call(), s),
                                call_of("backward", 1, Kernel::public_call(), s),
                                call_of("forward", 2, Kernel::chapter2(), s),
                                call_of("forward", 2, Kernel::with_bc(64), s)}) {
        const std::string line = deadline_message("C", call, 10);
        INFO(line);
        CHECK_THAT(line, Contains("__syncthreads") && Contains(call.kernel.name()) &&
                             Contains(std::string("chapter ") + std::to_string(call.chapter)));
    }
}

TEST_CASE("A run whose deadline passes ends at once: the test fails, the summary line follows, "
          "the exit code is 3", "[cpu][deadline]") {
    // In a child process (the run really ends), its output into a pipe.
    int out[2];
    REQUIRE(pipe(out) == 0);
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
        dup2(out[1], 1);
        dup2(out[1], 2);
        close(out[0]);
        end_run_on_deadline("DEADLINE: the line the harness would print");
    }
    close(out[1]);
    std::string text;
    char buffer[4096];
    for (ssize_t n; (n = read(out[0], buffer, sizeof buffer)) > 0;) text.append(buffer, size_t(n));
    close(out[0]);
    int status = 0;
    REQUIRE(waitpid(child, &status, 0) == child);
    INFO("the child printed:\n" << text);
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 3);
    CHECK_THAT(text, Contains("DEADLINE: the line the harness would print"));
    CHECK_THAT(text, Contains("A run whose deadline passes") && Contains("FAILED"));  // Catch's
    CHECK_THAT(text, Contains("flash tests: ") && Contains(" failed, "));
}

// =============================================================================================
// A kernel that really never finishes (tests/spin.cu), in a child process: the run must end in
// seconds with the message, the summary line and exit code 3, whatever Catch's options. Catch's
// -a and -x abort a run by throwing out of the failure; a run that then exits normally waits on
// the spinning kernel at exit (the CUDA runtime's teardown), so the harness exits first.

namespace {
// The hidden test cases the child runs: the kernel spins (30 s: far past the deadline, yet bounded
// if anything went wrong) and the host waits for it through the deadline's wait, or is blocked in
// a synchronising CUDA call, where only the watchdog thread can end the run.
const AttentionShape kSpinShape{1, 1, 1, 1, 64, false};
GpuCall spin_call() { return {"forward", "fp16", Kernel::chapter2(), kSpinShape, 2}; }

// This test binary run again in a child process, with one variable of the environment set:
// what it printed (stdout and stderr), its wait status, and how long it ran.
struct Child {
    std::string text;
    int status = 0;
    double seconds = 0;
};
Child run_child(const std::vector<const char*>& args, const char* name, const char* value) {
    int out[2];
    REQUIRE(pipe(out) == 0);
    std::fflush(stdout);
    std::fflush(stderr);
    const auto start = std::chrono::steady_clock::now();
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {  // a new process image: nothing of the parent's CUDA state is used
        dup2(out[1], 1);
        dup2(out[1], 2);
        close(out[0]);
        setenv(name, value, 1);
        std::vector<const char*> argv = {"test_flash"};
        argv.insert(argv.end(), args.begin(), args.end());
        argv.push_back(nullptr);
        execv("/proc/self/exe", const_cast<char* const*>(argv.data()));
        std::_Exit(127);
    }
    close(out[1]);
    Child c;
    char buffer[4096];
    for (ssize_t n; (n = read(out[0], buffer, sizeof buffer)) > 0;) c.text.append(buffer, size_t(n));
    close(out[0]);
    REQUIRE(waitpid(child, &c.status, 0) == child);
    c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return c;
}
}  // namespace

TEST_CASE("A spinning kernel waited for with the deadline (the child of the test below)",
          "[.spin-wait]") {
    launch_spinning_kernel(30);
    wait_for_gpu(0, spin_call());
    FAIL("the spinning kernel finished before its deadline");
}

TEST_CASE("A spinning kernel behind a blocking CUDA call (the child of the test below)",
          "[.spin-sync]") {
    const DeadlineGuard guard(spin_call());
    launch_spinning_kernel(30);
    FLASH_CUDA_CHECK(cudaDeviceSynchronize());  // blocks until the kernel ends: 30 s
    FAIL("the spinning kernel finished before its deadline");
}

TEST_CASE("A kernel that never finishes ends the run within seconds, under -a, -x 1 and another "
          "reporter", "[gpu][deadline]") {
    // The deadline scaled to 0.05: 0.5 s for the tiny call (10 s at scale 1), the watchdog 0.75 s.
    const std::vector<std::vector<const char*>> runs = {{"[.spin-wait]", "-a"},
                                                        {"[.spin-sync]", "-x", "1", "-r", "junit"}};
    for (const auto& args : runs) {
        std::string command = "FLASH_TEST_DEADLINE_SCALE=0.05 test_flash";
        for (const char* a : args) command += std::string(" ") + a;
        INFO("the child: " << command);
        const Child c = run_child(args, "FLASH_TEST_DEADLINE_SCALE", "0.05");
        INFO("it ran " << c.seconds << " s and printed:\n" << c.text);
        REQUIRE(WIFEXITED(c.status));
        CHECK(WEXITSTATUS(c.status) == 3);
        CHECK(c.seconds < 10.0);  // 0.5 to 0.75 s of deadline, the CUDA start-up, and the exit
        CHECK_THAT(c.text, Contains("DEADLINE: \"A spinning kernel"));
        CHECK_THAT(c.text, Contains("flash tests: 0 passed, 1 failed"));
    }
}

// The test case's own alarm, on the CPU: a child whose test case sleeps (as a test would that
// waits on the GPU outside every guarded call) ends at FLASH_TEST_CASE_SECONDS with the message.
TEST_CASE("A test case that sleeps past its alarm (the child of the test below)", "[.sleep-case]") {
    std::this_thread::sleep_for(std::chrono::seconds(30));
    FAIL("the alarm did not end the run");
}

TEST_CASE("A test case that does not end ends the run at its alarm, with the message",
          "[cpu][deadline]") {
    const Child c = run_child({"[.sleep-case]", "-a"}, "FLASH_TEST_CASE_SECONDS", "0.5");
    INFO("the child: FLASH_TEST_CASE_SECONDS=0.5 test_flash [.sleep-case] -a; it ran "
         << c.seconds << " s and printed:\n" << c.text);
    REQUIRE(WIFEXITED(c.status));
    CHECK(WEXITSTATUS(c.status) == 3);
    CHECK(c.seconds < 10.0);
    CHECK_THAT(c.text, Contains("DEADLINE: \"A test case that sleeps") &&
                           Contains("FLASH_TEST_CASE_SECONDS"));
    CHECK_THAT(c.text, Contains("flash tests: 0 passed, 1 failed"));
}

// Catch2 v2's console reporter prints a failing test case's name as a header, wrapping it under
// the name's first ": "; when that indent reaches the header's width (79 columns) it asserts and
// the run aborts before its summary, so a name's first ": " leaves at least 10 columns.
TEST_CASE("Every test case's name fits the header Catch prints when it fails", "[cpu][deadline]") {
    const size_t width = 79, room = 10;  // CATCH_CONFIG_CONSOLE_WIDTH (80) less one; columns left
    const auto& tests = Catch::getRegistryHub().getTestCaseRegistry().getAllTests();
    CHECK(tests.size() > 100);
    for (const Catch::TestCase& tc : tests) {
        const size_t colon = tc.name.find(": ");
        if (colon == std::string::npos) continue;
        INFO("\"" << tc.name << "\": its first \": \" ends at column " << colon + 2 << " of "
                  << width);
        CHECK(colon + 2 + room <= width);
    }
}
