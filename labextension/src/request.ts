/**
 * Requests to the jupyter-cedana REST API (`/api/cedana`).
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { IErrorBody, IKernel, IStatus, Tier } from './types';

/** The API's base path under the server's base URL. */
export const API_NAMESPACE = 'api/cedana';

/**
 * A failed request: the server's `{code, message}` where it sent one.
 */
export class CedanaAPIError extends Error {
  constructor(
    message: string,
    readonly code: string,
    readonly status: number
  ) {
    super(message);
    this.name = 'CedanaAPIError';
  }
}

/**
 * Call the API and return its JSON answer.
 *
 * @param endPoint path under `/api/cedana`, with any query string
 * @param init fetch options
 * @param settings server settings; the default ones when omitted
 */
export async function requestAPI<T>(
  endPoint = '',
  init: RequestInit = {},
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): Promise<T> {
  const url = URLExt.join(settings.baseUrl, API_NAMESPACE, endPoint);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new CedanaAPIError(
      `Cannot reach the server: ${(error as Error).message ?? error}`,
      'network_error',
      0
    );
  }
  const text = await response.text();
  let data: any = undefined;
  if (text.length > 0) {
    try {
      data = JSON.parse(text);
    } catch {
      data = undefined;
    }
  }
  if (!response.ok) {
    const body = data as Partial<IErrorBody> | undefined;
    const message =
      body && typeof body.message === 'string' && body.message
        ? body.message
        : `${response.status} ${response.statusText || 'error'}`.trim();
    const code = body && typeof body.code === 'string' ? body.code : 'error';
    throw new CedanaAPIError(message, code, response.status);
  }
  return data as T;
}

/** Options of a suspend. */
export interface ISuspendOptions {
  /** Wait for the suspend to finish (the default) or answer at once. */
  wait?: boolean;
  /** Where to put the kernel; the server's default (disk) when omitted. */
  tier?: Tier;
}

/** Options of a resume. */
export interface IResumeOptions {
  /** Wait for the resume to finish (the default) or answer at once. */
  wait?: boolean;
}

function kernelPath(id: string, action?: string): string {
  const base = `kernels/${encodeURIComponent(id)}`;
  return action ? `${base}/${action}` : base;
}

function query(params: Record<string, string | undefined>): string {
  const entries = Object.entries(params).filter(
    (entry): entry is [string, string] => entry[1] !== undefined
  );
  if (entries.length === 0) {
    return '';
  }
  return (
    '?' +
    entries
      .map(([k, v]) => `${encodeURIComponent(k)}=${encodeURIComponent(v)}`)
      .join('&')
  );
}

/** Every kernel of the server. */
export function listKernels(
  settings?: ServerConnection.ISettings
): Promise<IKernel[]> {
  return requestAPI<IKernel[]>('kernels', { method: 'GET' }, settings);
}

/** One kernel. */
export function getKernel(
  id: string,
  settings?: ServerConnection.ISettings
): Promise<IKernel> {
  return requestAPI<IKernel>(kernelPath(id), { method: 'GET' }, settings);
}

/** Suspend a kernel now. */
export function suspendKernel(
  id: string,
  options: ISuspendOptions = {},
  settings?: ServerConnection.ISettings
): Promise<IKernel> {
  const q = query({
    wait: options.wait === false ? '0' : undefined,
    tier: options.tier
  });
  return requestAPI<IKernel>(
    kernelPath(id, 'suspend') + q,
    { method: 'POST' },
    settings
  );
}

/** Resume a kernel now. */
export function resumeKernel(
  id: string,
  options: IResumeOptions = {},
  settings?: ServerConnection.ISettings
): Promise<IKernel> {
  const q = query({ wait: options.wait === false ? '0' : undefined });
  return requestAPI<IKernel>(
    kernelPath(id, 'resume') + q,
    { method: 'POST' },
    settings
  );
}

/** Keep a kernel awake for `seconds` from now; 0 clears it. */
export function keepAwake(
  id: string,
  seconds: number,
  settings?: ServerConnection.ISettings
): Promise<IKernel> {
  return requestAPI<IKernel>(
    kernelPath(id, 'keep-awake'),
    {
      method: 'POST',
      body: JSON.stringify({ seconds }),
      headers: { 'Content-Type': 'application/json' }
    },
    settings
  );
}

/** Engine availability and checkpoint storage. */
export function getStatus(
  settings?: ServerConnection.ISettings
): Promise<IStatus> {
  return requestAPI<IStatus>('status', { method: 'GET' }, settings);
}
