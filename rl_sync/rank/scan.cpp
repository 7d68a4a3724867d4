// One C pass over the objects and tensors a rank's watch follows (built and loaded by native.py).
//
// bind(torch.Tensor)              the type every tensor argument must be (called once, at load)
// impl_address(tensor)            the TensorImpl address read off `tensor` (its `_cdata`)
// differ(a, b)                    positions i where a[i] is not b[i]
// mapping_differ(mapping, keys, values)
//                                 for a dict whose keys are `keys`, in order (the same objects or
//                                 equal ones), the positions i where its i-th value is not values[i];
//                                 None when it holds other keys (another count, order or names)
// held_moved(holders, keys, held, item)
//                                 positions i where holders[i][keys[i]] (item) or
//                                 getattr(holders[i], keys[i]) is not held[i] (missing: moved)
// record(tensors, rows, slots)    rows[k] = the layout of tensors[k], for each k in slots;
//                                 returns the slots recorded as UNRECORDED, in the order given
// moved(tensors, rows)            positions k where the layout of tensors[k] differs from rows[k]
//
// A layout row is ROW int64 words: data pointer, (dim, dtype, device) packed, sizes, strides.
// A tensor of more than MAX_DIM dims, or whose layout cannot be read, is recorded as
// UNRECORDED and never reported by moved() (the caller checks those itself).
#include <Python.h>
#include <c10/core/TensorImpl.h>
#include <torch/version.h>

#include <cstdint>
#include <cstring>

#include "module.h"

namespace {

// The head of torch's Python tensor object (THPVariable, torch/csrc/autograd/python_variable.h):
// the tensor right after the object header, a plain Tensor since torch 2.10 and a MaybeOwned
// Tensor (a flag, then the Tensor) before; a Tensor is one pointer to its TensorImpl. native.py
// checks, when it loads this module, that what is read here is each kind of tensor's `_cdata`.
struct Variable {
  PyObject_HEAD
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 10
  bool borrowed;
#endif
  c10::TensorImpl* impl;
};

PyTypeObject* tensor_type = nullptr;

constexpr int64_t MAX_DIM = 4;
constexpr int64_t ROW = 2 + 2 * MAX_DIM;
constexpr int64_t UNRECORDED = -1;
constexpr Py_ssize_t AHEAD = 8;

void layout(const c10::TensorImpl* impl, int64_t* row) {
  std::memset(row, 0, ROW * sizeof(int64_t));
  row[1] = UNRECORDED;
  try {
    const int64_t dim = impl->dim();
    if (dim > MAX_DIM) {
      return;
    }
    const c10::Device device = impl->device();
    const auto sizes = impl->sizes();
    const auto strides = impl->strides();
    for (int64_t d = 0; d < dim; ++d) {
      row[2 + d] = sizes[d];
      row[2 + MAX_DIM + d] = strides[d];
    }
    row[0] = reinterpret_cast<int64_t>(impl->data());
    row[1] = dim | (static_cast<int64_t>(impl->dtype().toScalarType()) << 8) |
        (static_cast<int64_t>(device.type()) << 16) | ((static_cast<int64_t>(device.index()) + 1) << 24);
  } catch (const std::exception&) {
    std::memset(row, 0, ROW * sizeof(int64_t));
    row[1] = UNRECORDED;
  }
}

// The TensorImpl of `obj`, or nullptr with a TypeError naming `what` when it is no tensor.
const c10::TensorImpl* impl_of(PyObject* obj, const char* what) {
  if (tensor_type == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "bind(torch.Tensor) was not called");
    return nullptr;
  }
  if (!PyObject_TypeCheck(obj, tensor_type)) {
    PyErr_Format(PyExc_TypeError, "%s is a %s, not a tensor", what, Py_TYPE(obj)->tp_name);
    return nullptr;
  }
  return reinterpret_cast<Variable*>(obj)->impl;
}

// Start loading what moved() reads a few tensors ahead (each tensor's Python object, its
// TensorImpl, and its storage lie in memory of their own: chased one by one, every step waits).
void prefetch(PyObject* tensors, Py_ssize_t k, Py_ssize_t count) {
  if (k + 3 * AHEAD < count) {
    __builtin_prefetch(PyList_GET_ITEM(tensors, k + 3 * AHEAD));
  }
  if (k + 2 * AHEAD < count && Py_IS_TYPE(PyList_GET_ITEM(tensors, k + 2 * AHEAD), tensor_type)) {
    const char* impl = reinterpret_cast<const char*>(reinterpret_cast<Variable*>(PyList_GET_ITEM(tensors, k + 2 * AHEAD))->impl);
    __builtin_prefetch(impl);
    __builtin_prefetch(impl + 64);
  }
  if (k + AHEAD < count && Py_IS_TYPE(PyList_GET_ITEM(tensors, k + AHEAD), tensor_type)) {
    const c10::TensorImpl* impl = reinterpret_cast<Variable*>(PyList_GET_ITEM(tensors, k + AHEAD))->impl;
    __builtin_prefetch(impl->unsafe_storage().unsafeGetStorageImpl());
  }
}

bool is_list(PyObject* obj, const char* what) {
  if (!PyList_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s must be a list, got %s", what, Py_TYPE(obj)->tp_name);
    return false;
  }
  return true;
}

bool same_length(PyObject* a, PyObject* b, const char* what) {
  if (PyList_GET_SIZE(a) != PyList_GET_SIZE(b)) {
    PyErr_Format(PyExc_ValueError, "%s: lists of %zd and %zd items", what, PyList_GET_SIZE(a), PyList_GET_SIZE(b));
    return false;
  }
  return true;
}

bool append_index(PyObject* out, Py_ssize_t i) {
  PyObject* index = PyLong_FromSsize_t(i);
  if (index == nullptr) {
    return false;
  }
  const int failed = PyList_Append(out, index);
  Py_DECREF(index);
  return failed == 0;
}

// The rows of `rows_obj`, a contiguous CPU int64 tensor of at least `count` rows of ROW words.
int64_t* rows_of(PyObject* rows_obj, Py_ssize_t count) {
  const c10::TensorImpl* rows = impl_of(rows_obj, "rows");
  if (rows == nullptr) {
    return nullptr;
  }
  if (rows->dim() != 2 || rows->sizes()[1] != ROW || rows->sizes()[0] < count ||
      rows->dtype().toScalarType() != c10::ScalarType::Long || rows->device_type() != c10::DeviceType::CPU ||
      !rows->is_contiguous()) {
    PyErr_Format(
        PyExc_ValueError, "rows must be a contiguous CPU int64 tensor of at least %zd rows of %lld words", count,
        static_cast<long long>(ROW));
    return nullptr;
  }
  return static_cast<int64_t*>(const_cast<void*>(rows->data()));
}

PyObject* bind(PyObject*, PyObject* type) {
  if (!PyType_Check(type)) {
    PyErr_Format(PyExc_TypeError, "bind takes torch.Tensor, got %s", Py_TYPE(type)->tp_name);
    return nullptr;
  }
  Py_INCREF(type);
  Py_XDECREF(reinterpret_cast<PyObject*>(tensor_type));
  tensor_type = reinterpret_cast<PyTypeObject*>(type);
  Py_RETURN_NONE;
}

PyObject* impl_address(PyObject*, PyObject* obj) {
  const c10::TensorImpl* impl = impl_of(obj, "the argument");
  return impl == nullptr ? nullptr : PyLong_FromVoidPtr(const_cast<c10::TensorImpl*>(impl));
}

PyObject* differ(PyObject*, PyObject* args) {
  PyObject *a, *b;
  if (!PyArg_ParseTuple(args, "OO", &a, &b) || !is_list(a, "a") || !is_list(b, "b") || !same_length(a, b, "differ")) {
    return nullptr;
  }
  PyObject* out = PyList_New(0);
  for (Py_ssize_t i = 0; out != nullptr && i < PyList_GET_SIZE(a); ++i) {
    if (PyList_GET_ITEM(a, i) != PyList_GET_ITEM(b, i) && !append_index(out, i)) {
      Py_CLEAR(out);
    }
  }
  return out;
}

// Whether dict key `key` is `want` or equal to it (1, 0, or -1 with an exception set); both are
// held while a comparison that is not of two str objects runs Python code.
int same_key(PyObject* key, PyObject* want) {
  if (key == want) {
    return 1;
  }
  if (PyUnicode_CheckExact(key) && PyUnicode_CheckExact(want)) {
    return PyUnicode_Compare(key, want) == 0 ? 1 : (PyErr_Occurred() ? -1 : 0);
  }
  Py_INCREF(key);
  Py_INCREF(want);
  const int equal = PyObject_RichCompareBool(key, want, Py_EQ);
  Py_DECREF(key);
  Py_DECREF(want);
  return equal;
}

PyObject* mapping_differ(PyObject*, PyObject* args) {
  PyObject *mapping, *keys, *values;
  if (!PyArg_ParseTuple(args, "O!OO", &PyDict_Type, &mapping, &keys, &values) || !is_list(keys, "keys") ||
      !is_list(values, "values") || !same_length(keys, values, "mapping_differ")) {
    return nullptr;
  }
  if (PyDict_GET_SIZE(mapping) != PyList_GET_SIZE(keys)) {
    Py_RETURN_NONE;
  }
  PyObject* out = PyList_New(0);
  Py_ssize_t pos = 0, i = 0;
  PyObject *key, *value;
  while (out != nullptr && i < PyList_GET_SIZE(keys) && PyDict_Next(mapping, &pos, &key, &value)) {
    const int same = same_key(key, PyList_GET_ITEM(keys, i));
    if (same <= 0) {
      Py_CLEAR(out);
      if (same == 0) {
        Py_RETURN_NONE;
      }
      break;
    }
    if (value != PyList_GET_ITEM(values, i) && !append_index(out, i)) {
      Py_CLEAR(out);
    }
    ++i;
  }
  if (out != nullptr && i != PyList_GET_SIZE(keys)) {  // (changed under a comparison)
    Py_CLEAR(out);
    Py_RETURN_NONE;
  }
  return out;
}

PyObject* held_moved(PyObject*, PyObject* args) {
  PyObject *holders, *keys, *held;
  int item;
  if (!PyArg_ParseTuple(args, "OOOp", &holders, &keys, &held, &item) || !is_list(holders, "holders") ||
      !is_list(keys, "keys") || !is_list(held, "held") || !same_length(holders, keys, "held_moved") ||
      !same_length(holders, held, "held_moved")) {
    return nullptr;
  }
  PyObject* out = PyList_New(0);
  for (Py_ssize_t i = 0; out != nullptr && i < PyList_GET_SIZE(holders); ++i) {
    PyObject* holder = PyList_GET_ITEM(holders, i);
    PyObject* key = PyList_GET_ITEM(keys, i);
    PyObject* now = item ? PyObject_GetItem(holder, key) : PyObject_GetAttr(holder, key);
    if (now == nullptr) {
      if (!PyErr_ExceptionMatches(item ? PyExc_KeyError : PyExc_AttributeError)) {
        Py_CLEAR(out);
        break;
      }
      PyErr_Clear();
    }
    const bool moved = now != PyList_GET_ITEM(held, i);
    Py_XDECREF(now);
    if (moved && !append_index(out, i)) {
      Py_CLEAR(out);
    }
  }
  return out;
}

PyObject* record(PyObject*, PyObject* args) {
  PyObject *tensors, *rows_obj, *slots;
  if (!PyArg_ParseTuple(args, "OOO", &tensors, &rows_obj, &slots) || !is_list(tensors, "tensors") ||
      !is_list(slots, "slots")) {
    return nullptr;
  }
  const Py_ssize_t count = PyList_GET_SIZE(tensors);
  int64_t* rows = rows_of(rows_obj, count);
  if (rows == nullptr) {
    return nullptr;
  }
  PyObject* unrecorded = PyList_New(0);
  for (Py_ssize_t i = 0; unrecorded != nullptr && i < PyList_GET_SIZE(slots); ++i) {
    const Py_ssize_t k = PyLong_AsSsize_t(PyList_GET_ITEM(slots, i));
    if (k == -1 && PyErr_Occurred()) {
      Py_CLEAR(unrecorded);
      break;
    }
    if (k < 0 || k >= count) {
      PyErr_Format(PyExc_IndexError, "slot %zd is outside the %zd tensors", k, count);
      Py_CLEAR(unrecorded);
      break;
    }
    const c10::TensorImpl* impl = impl_of(PyList_GET_ITEM(tensors, k), "an item of tensors");
    if (impl == nullptr) {
      Py_CLEAR(unrecorded);
      break;
    }
    layout(impl, rows + k * ROW);
    if (rows[k * ROW + 1] == UNRECORDED && !append_index(unrecorded, k)) {
      Py_CLEAR(unrecorded);
    }
  }
  return unrecorded;
}

PyObject* moved(PyObject*, PyObject* args) {
  PyObject *tensors, *rows_obj;
  if (!PyArg_ParseTuple(args, "OO", &tensors, &rows_obj) || !is_list(tensors, "tensors")) {
    return nullptr;
  }
  const Py_ssize_t count = PyList_GET_SIZE(tensors);
  const int64_t* rows = rows_of(rows_obj, count);
  if (rows == nullptr) {
    return nullptr;
  }
  PyObject* out = PyList_New(0);
  int64_t now[ROW];
  for (Py_ssize_t k = 0; out != nullptr && k < count; ++k) {
    prefetch(tensors, k, count);
    const int64_t* was = rows + k * ROW;
    if (was[1] == UNRECORDED) {
      continue;
    }
    const c10::TensorImpl* impl = impl_of(PyList_GET_ITEM(tensors, k), "an item of tensors");
    if (impl == nullptr) {
      Py_CLEAR(out);
      break;
    }
    layout(impl, now);
    if (std::memcmp(now, was, sizeof(now)) != 0 && !append_index(out, k)) {
      Py_CLEAR(out);
    }
  }
  return out;
}

PyMethodDef methods[] = {
    {"bind", bind, METH_O, "Take torch.Tensor as the type every tensor argument must be."},
    {"impl_address", impl_address, METH_O, "The TensorImpl address read off a tensor (its _cdata)."},
    {"differ", differ, METH_VARARGS, "Positions where a[i] is not b[i]."},
    {"mapping_differ", mapping_differ, METH_VARARGS, "Positions where a dict's i-th value is not values[i]."},
    {"held_moved", held_moved, METH_VARARGS, "Positions where holders[i][keys[i]] is not held[i]."},
    {"record", record, METH_VARARGS,
     "Record the layout of tensors[k] in rows[k] for each k in slots; the slots left UNRECORDED."},
    {"moved", moved, METH_VARARGS, "Positions whose tensor's layout differs from its row."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

RL_SYNC_MODULE(methods)
