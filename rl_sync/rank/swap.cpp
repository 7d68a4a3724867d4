// The memory behind two storages exchanged in O(1), for PyTorch releases without
// UntypedStorage._swap_data_ptr_ (built and loaded by native.py; used by rl_sync.rank.swap).
//
// swap(a, b)    a and b: two storages' StorageImpl addresses (UntypedStorage._cdata), of the
//               same size on the same device; afterwards each holds the other's memory (its
//               allocation and the deleter that frees it, the allocator that resizes it and
//               whether it may), so every tensor over either one reads the other's bytes. The
//               caller holds both storages for the call.
#include <Python.h>
#include <c10/core/StorageImpl.h>

#include <string>

#include "module.h"

namespace {

c10::StorageImpl* storage_at(PyObject* address, const char* what) {
  void* pointer = PyLong_AsVoidPtr(address);
  if (pointer == nullptr && !PyErr_Occurred()) {
    PyErr_Format(PyExc_ValueError, "swap: %s is a null StorageImpl address; expected UntypedStorage._cdata", what);
  }
  return static_cast<c10::StorageImpl*>(pointer);
}

PyObject* swap(PyObject*, PyObject* args) {
  PyObject *first = nullptr, *second = nullptr;
  if (!PyArg_ParseTuple(args, "O!O!:swap", &PyLong_Type, &first, &PyLong_Type, &second)) {
    return nullptr;
  }
  c10::StorageImpl* a = storage_at(first, "a");
  if (a == nullptr) {
    return nullptr;
  }
  c10::StorageImpl* b = storage_at(second, "b");
  if (b == nullptr) {
    return nullptr;
  }
  if (a->nbytes() != b->nbytes() || a->device() != b->device()) {
    const std::string message = "swap: storages of " + std::to_string(a->nbytes()) + " bytes on " +
        a->device().str() + " and " + std::to_string(b->nbytes()) + " bytes on " + b->device().str() +
        "; expected the same size on the same device";
    PyErr_SetString(PyExc_ValueError, message.c_str());
    return nullptr;
  }
  try {
    at::DataPtr held = a->set_data_ptr(std::move(b->mutable_data_ptr()));
    b->set_data_ptr(std::move(held));
    c10::Allocator* allocator = a->allocator();
    const bool resizable = a->resizable();
    a->set_allocator(b->allocator());
    b->set_allocator(allocator);
    a->set_resizable(b->resizable());
    b->set_resizable(resizable);
  } catch (const c10::Error& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what_without_backtrace());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"swap", swap, METH_VARARGS, "Exchange the memory behind two storages (their _cdata addresses)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

RL_SYNC_MODULE(methods)
