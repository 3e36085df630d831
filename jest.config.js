/**
 * Jest runs the frontend unit tests (labextension/src/__tests__).
 * TypeScript goes through ts-jest; ES-module dependencies through babel.
 */
const esModules = [
  '@codemirror',
  '@jupyter/ydoc',
  '@jupyterlab/',
  '@jupyter/',
  '@microsoft/',
  'exenv-es6',
  'lib0',
  'nanoid',
  'vscode-ws-jsonrpc',
  'y-protocols',
  'y-websocket',
  'yjs'
].join('|');

module.exports = {
  // jsdom with Node's fetch, Request, Response and Headers.
  testEnvironment: '<rootDir>/labextension/src/__tests__/environment.js',
  roots: ['<rootDir>/labextension/src'],
  testRegex: 'labextension/src/__tests__/.*\\.spec\\.tsx?$',
  moduleFileExtensions: ['ts', 'tsx', 'js', 'jsx', 'json', 'node'],
  moduleNameMapper: {
    '\\.(css|less|sass|scss)$':
      '<rootDir>/labextension/src/__tests__/style-mock.js',
    '\\.(svg)$': '<rootDir>/labextension/src/__tests__/style-mock.js'
  },
  transform: {
    '^.+\\.tsx?$': ['ts-jest', { tsconfig: 'tsconfig.test.json' }],
    '^.+\\.jsx?$': 'babel-jest'
  },
  transformIgnorePatterns: [`/node_modules/(?!(${esModules}))`],
  setupFiles: ['<rootDir>/labextension/src/__tests__/setup.js'],
  collectCoverageFrom: [
    'labextension/src/**/*.{ts,tsx}',
    '!labextension/src/**/*.d.ts',
    '!labextension/src/__tests__/**'
  ],
  coverageReporters: ['lcov', 'text']
};
