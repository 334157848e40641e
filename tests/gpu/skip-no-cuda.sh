#!/bin/sh
echo "SKIP: built without CUDA (nvcc not found)"
exit 77
