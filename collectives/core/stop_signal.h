// SIGINT and SIGTERM as a request to stop at the next safe point, shared by every long-running
// program (trn-train, trn-data tokenize, trn-plan's search).
//
// install() replaces the handlers of both signals. A signal is recorded (received() returns it)
// for the program to act on at its next check; a second signal ends the process at once with
// exit 128 + signal. While stops are not deferred (set_deferred(false): a phase with no check
// that would read the flag soon, which writes nothing a signal could leave half-done), a signal
// instead ends the process at once, by that signal.
#pragma once

namespace trn::stop_signal {

void install(bool deferred = true);
void set_deferred(bool deferred);
int received();  // the first signal received, or 0

}  // namespace trn::stop_signal
