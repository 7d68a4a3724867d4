// The Python module a source built by native.py defines: RL_SYNC_MODULE(methods) at the end of the
// source, outside any namespace, makes `methods` the module named TORCH_EXTENSION_NAME.
#pragma once
#include <Python.h>

#define RL_SYNC_TEXT(name) #name
#define RL_SYNC_NAME(name) RL_SYNC_TEXT(name)
#define RL_SYNC_INIT_NAME(name) PyInit_##name
#define RL_SYNC_INIT(name) RL_SYNC_INIT_NAME(name)

#define RL_SYNC_MODULE(methods)                                                                  \
  static PyModuleDef rl_sync_module = {                                                          \
      PyModuleDef_HEAD_INIT, RL_SYNC_NAME(TORCH_EXTENSION_NAME), nullptr, -1, methods};          \
  PyMODINIT_FUNC RL_SYNC_INIT(TORCH_EXTENSION_NAME)() {                                          \
    return PyModule_Create(&rl_sync_module);                                                     \
  }
