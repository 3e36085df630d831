/**
 * A fake jupyter-cedana server for the unit tests: a `fetch` that routes
 * requests to handlers and records them.
 */
import { ServerConnection, Session } from '@jupyterlab/services';
import { Signal } from '@lumino/signaling';

import { IKernel, IStatus } from '../types';

export const BASE_URL = 'http://localhost:8888/lab-base/';

export interface IRecordedRequest {
  method: string;
  path: string;
  query: URLSearchParams;
  headers: Headers;
  body: string;
}

export type Handler = (request: IRecordedRequest) => {
  status?: number;
  body?: unknown;
  raw?: string;
};

/** A routing fetch with recorded requests. */
export class FakeServer {
  requests: IRecordedRequest[] = [];
  routes = new Map<string, Handler>();

  /** Route `METHOD path` (path under /api/cedana/, without query). */
  on(method: string, path: string, handler: Handler): this {
    this.routes.set(`${method} ${path}`, handler);
    return this;
  }

  fetch = async (input: RequestInfo | URL, init?: RequestInit) => {
    const request = input instanceof Request ? input : new Request(input, init);
    const url = new URL(request.url);
    const prefix = new URL(BASE_URL).pathname + 'api/cedana/';
    const path = url.pathname.startsWith(prefix)
      ? url.pathname.slice(prefix.length)
      : url.pathname;
    const recorded: IRecordedRequest = {
      method: request.method,
      path: decodeURIComponent(path),
      query: url.searchParams,
      headers: request.headers,
      body: await request.text()
    };
    this.requests.push(recorded);
    const handler = this.routes.get(`${request.method} ${recorded.path}`);
    if (!handler) {
      return new Response(
        JSON.stringify({ code: 'not_found', message: `No route ${path}` }),
        { status: 404, headers: { 'Content-Type': 'application/json' } }
      );
    }
    const answer = handler(recorded);
    const body =
      answer.raw !== undefined
        ? answer.raw
        : answer.body === undefined
          ? ''
          : JSON.stringify(answer.body);
    return new Response(body, {
      status: answer.status ?? 200,
      statusText: answer.status && answer.status >= 400 ? 'Error' : 'OK',
      headers: { 'Content-Type': 'application/json' }
    });
  };

  settings(token = 'secret-token'): ServerConnection.ISettings {
    return ServerConnection.makeSettings({
      baseUrl: BASE_URL,
      wsUrl: 'ws://localhost:8888/lab-base/',
      token,
      fetch: this.fetch as any,
      Request,
      Headers
    });
  }
}

/** A kernel as the server describes it. */
export function makeKernel(overrides: Partial<IKernel> = {}): IKernel {
  return {
    id: 'k1',
    name: 'python3',
    state: 'running',
    tier: null,
    execution_state: 'idle',
    last_activity: '2030-01-01T00:00:00.000Z',
    idle_seconds: 60,
    suspend_at: '2030-01-01T00:10:00.000Z',
    suspended_at: null,
    keep_awake_until: null,
    checkpoint_bytes: 0,
    last_suspend_seconds: null,
    last_resume_seconds: null,
    gpus: [],
    suspendable: true,
    reason: null,
    progress: null,
    ...overrides
  };
}

export function makeStatus(overrides: Partial<IStatus> = {}): IStatus {
  return {
    available: true,
    reason: null,
    criu_version: '4.2.1',
    root: true,
    checkpoint_root: '/tmp/ckpt',
    bytes_used: 0,
    bytes_free: 10e9,
    gpu: {
      available: false,
      reason: 'no driver',
      devices: [],
      checkpoint: false
    },
    ...overrides
  };
}

/** A session manager with the fields the model uses. */
export class FakeSessions {
  models: Session.IModel[] = [];
  runningChanged = new Signal<this, Session.IModel[]>(this);

  running(): IterableIterator<Session.IModel> {
    return this.models[Symbol.iterator]();
  }

  add(path: string, kernelId: string): void {
    this.models.push({
      id: `s-${kernelId}`,
      name: path,
      path,
      type: 'notebook',
      kernel: { id: kernelId, name: 'python3' }
    });
    this.runningChanged.emit(this.models);
  }
}

/** An event manager with the fields the model uses. */
export class FakeEvents {
  stream = new Signal<this, { schema_id: string; [key: string]: any }>(this);
}

/** Wait for pending promises and timers of `ms` milliseconds. */
export function sleep(ms = 0): Promise<void> {
  return new Promise(resolve => setTimeout(resolve, ms));
}
