#pragma once
// Ctrl-C (and Jupyter's "interrupt kernel", which sends SIGINT) during a kernel call. Python runs
// signal handlers only on its main thread and only when that thread holds the GIL, so a call
// that released it would finish before a KeyboardInterrupt could be raised. ReleaseGil, used
// instead of py::gil_scoped_release around kernel calls, installs an InterruptPoll (the core's
// hook, see attnlab/threading.hpp) that takes the GIL back for a moment and runs the pending
// handlers with PyErr_CheckSignals. When a handler raises, the poll keeps its exception, the
// kernel unwinds with attnlab::Interrupted, and the exception is raised again once the GIL is
// back (the translator in module.cpp leaves it in place). The core never touches Python.
#include <pybind11/pybind11.h>

#include "attnlab/threading.hpp"

namespace attnlab {
namespace bind {

namespace py = pybind11;

// threading.main_thread().ident, set when the module is imported (module.cpp).
inline unsigned long g_main_thread = 0;

class ReleaseGil {
  public:
    ReleaseGil()
        : poll_(PyThread_get_thread_ident() == g_main_thread ? &ReleaseGil::poll : nullptr, this),
          state_(PyEval_SaveThread()) {}
    // With the GIL held again: the exception a signal handler raised is pending once more.
    ~ReleaseGil() {
        PyEval_RestoreThread(state_);
        if (interrupted_) restore();
    }
    ReleaseGil(const ReleaseGil&) = delete;
    ReleaseGil& operator=(const ReleaseGil&) = delete;

  private:
    // On the calling thread, the GIL released: whether a signal handler raised.
    static bool poll(void* context) {
        auto* self = static_cast<ReleaseGil*>(context);
        PyEval_RestoreThread(self->state_);
        const bool raised = PyErr_CheckSignals() != 0;
        if (raised) {
            self->fetch();
            self->interrupted_ = true;
        }
        self->state_ = PyEval_SaveThread();
        return raised;
    }
#if PY_VERSION_HEX >= 0x030C0000
    void fetch() { raised_ = PyErr_GetRaisedException(); }
    void restore() { PyErr_SetRaisedException(raised_); }
#else
    void fetch() { PyErr_Fetch(&raised_type_, &raised_, &raised_traceback_); }
    void restore() { PyErr_Restore(raised_type_, raised_, raised_traceback_); }
    PyObject *raised_type_ = nullptr, *raised_traceback_ = nullptr;
#endif

    InterruptPoll poll_;  // constructed before the GIL is released, removed after it is back
    PyThreadState* state_;
    PyObject* raised_ = nullptr;  // owned until restore() hands it back to the interpreter
    bool interrupted_ = false;
};

}  // namespace bind
}  // namespace attnlab
