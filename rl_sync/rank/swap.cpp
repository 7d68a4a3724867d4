// The memory behind storages exchanged in O(1), for PyTorch releases without
// UntypedStorage._swap_data_ptr_ (built and loaded by native.py; used by rl_sync.rank.swap).
//
// swap(a, b)    a and b: lists of storages' StorageImpl addresses (UntypedStorage._cdata), the
//               storages of a[i] and b[i] of the same size on the same device; afterwards each
//               holds the other's memory (its allocation and the deleter that frees it, the
//               allocator that resizes it and whether it may), so every tensor over either one
//               reads the other's bytes. Every pair is checked, and every storage's memory made
//               writable (a copy-on-write one materialized), before any is swapped: a refusal
//               swaps none. The caller holds every storage for the call.
#include <Python.h>
#include <c10/core/StorageImpl.h>

#include <exception>
#include <string>
#include <vector>

#include "module.h"

namespace {

// The StorageImpl addresses of the list `list` (named `what` in errors), or false with an error set.
bool storages_at(PyObject* list, const char* what, std::vector<c10::StorageImpl*>& out) {
  if (!PyList_Check(list)) {
    PyErr_Format(PyExc_TypeError, "swap: %s must be a list of UntypedStorage._cdata, got %s", what,
                 Py_TYPE(list)->tp_name);
    return false;
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); ++i) {
    PyObject* item = PyList_GET_ITEM(list, i);
    if (!PyLong_Check(item)) {
      PyErr_Format(PyExc_TypeError, "swap: %s[%zd] is a %s, not UntypedStorage._cdata (an int)", what, i,
                   Py_TYPE(item)->tp_name);
      return false;
    }
    void* pointer = PyLong_AsVoidPtr(item);
    if (pointer == nullptr) {
      if (!PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "swap: %s[%zd] is a null StorageImpl address; expected UntypedStorage._cdata",
                     what, i);
      }
      return false;
    }
    out.push_back(static_cast<c10::StorageImpl*>(pointer));
  }
  return true;
}

// Whether a and b can exchange their memory; else false with a ValueError naming both.
bool alike(const c10::StorageImpl* a, const c10::StorageImpl* b) {
  if (a->nbytes() == b->nbytes() && a->device() == b->device()) {
    return true;
  }
  const std::string message = "swap: storages of " + std::to_string(a->nbytes()) + " bytes on " + a->device().str() +
      " and " + std::to_string(b->nbytes()) + " bytes on " + b->device().str() +
      "; expected the same size on the same device";
  PyErr_SetString(PyExc_ValueError, message.c_str());
  return false;
}

void exchange(c10::StorageImpl* a, c10::StorageImpl* b) {
  at::DataPtr held = a->set_data_ptr(std::move(b->mutable_data_ptr()));
  b->set_data_ptr(std::move(held));
  c10::Allocator* allocator = a->allocator();
  const bool resizable = a->resizable();
  a->set_allocator(b->allocator());
  b->set_allocator(allocator);
  a->set_resizable(b->resizable());
  b->set_resizable(resizable);
}

PyObject* swap(PyObject*, PyObject* args) {
  PyObject *first = nullptr, *second = nullptr;
  if (!PyArg_ParseTuple(args, "OO:swap", &first, &second)) {
    return nullptr;
  }
  std::vector<c10::StorageImpl*> a, b;
  if (!storages_at(first, "a", a) || !storages_at(second, "b", b)) {
    return nullptr;
  }
  if (a.size() != b.size()) {
    PyErr_Format(PyExc_ValueError, "swap: lists of %zu and %zu storages; expected pairs", a.size(), b.size());
    return nullptr;
  }
  for (size_t i = 0; i < a.size(); ++i) {
    if (!alike(a[i], b[i])) {
      return nullptr;
    }
  }
  try {
    for (size_t i = 0; i < a.size(); ++i) {  // what may refuse or allocate (copy-on-write), before any swap
      a[i]->mutable_data_ptr();
      b[i]->mutable_data_ptr();
    }
  } catch (const c10::Error& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what_without_backtrace());
    return nullptr;
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
  for (size_t i = 0; i < a.size(); ++i) {
    exchange(a[i], b[i]);
  }
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"swap", swap, METH_VARARGS, "Exchange the memory behind the storages of each pair a[i], b[i] (_cdata addresses)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

RL_SYNC_MODULE(methods)
