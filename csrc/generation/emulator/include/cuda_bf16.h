// Emulator stand-in for the CUDA toolkit header of the same name (see ../cuda_emulator.h).
#pragma once
#include "../cuda_emulator.h"
